/* Weight-only integer matmuls with int8 activations: y[M, N] = x[M, K] @ W^T, W[n, k] = q[n, k] * s[n, g] + z[n, g]
 * for the group g = k / G, as in quant_matmul.c, but with x quantized per (row, group) to int8 first:
 *   x[m, k] ~ dx[m, g] * xq[m, k],  dx = max |x[m, group]| / 127,  xq = round-to-nearest(x / dx) in -127..127,
 * so that each group's products are integer dot products (VNNI `vpdpbusd`: four u8 x s8 products summed into each
 * int32 lane in one instruction) and the affine weight enters once per group in float:
 *   y[m, n] += dx[m, g] * (s[n, g] * sum_k q[n, k] xq[m, k] + z[n, g] * sum_k xq[m, k]).
 * The only error beyond float rounding is x's rounding to int8: at most dx / 2 per element.
 *
 * Layout (packed once at load by vx/kernels/quant_matmul.py). Output features come in panels of L = one vector of
 * int32 lanes (16 with AVX-512, 8 with AVX2); in a panel, each lane holds 4 consecutive k of its feature:
 *   int4:  q[panel][k / 8][L][4] bytes: byte i of lane j holds q[n0 + j, 8t + i] in its low nibble and
 *          q[n0 + j, 8t + 4 + i] in its high one (one vector load gives two k-quads after a mask and a shift)
 *   int8:  q[panel][k / 4][L][4] bytes, q + 128 (unsigned: vpdpbusd multiplies unsigned by signed bytes; the
 *          128 * sum(xq) it adds is taken off through the zero: z - 128 s)
 *   sz:    [panel][group][2][L] float32 or float16, scales then zeros, as in quant_matmul.c
 * G must be a multiple of 8 (whole k-quad pairs per group). N is padded to whole panels with zero weights.
 *
 * Dot products: AVX512-VNNI (512-bit, or 256-bit with AVX512-VL), AVX-VNNI, or AVX2's maddubs + madd for 4-bit
 * weights only (its int16 pair sums would saturate with 8-bit ones: 2 * 255 * 127 > 32767). `vx_i8_support`
 * says which bit widths this build serves (0: none, use quant_matmul.c).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef VX_VEC_BYTES
#if defined(__AVX512F__)
#define VX_VEC_BYTES 64
#else
#define VX_VEC_BYTES 32
#endif
#endif
#define AI static inline __attribute__((always_inline))

#if VX_VEC_BYTES == 64 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DOT_VNNI 1
#define SUPPORT ((1 << 4) | (1 << 8))
#elif VX_VEC_BYTES == 32 && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define DOT_VNNI 1
#define SUPPORT ((1 << 4) | (1 << 8))
#elif VX_VEC_BYTES == 32 && defined(__AVX2__)
#define DOT_VNNI 0
#define SUPPORT (1 << 4)
#else
#define DOT_VNNI 0
#define SUPPORT 0
#endif

#if SUPPORT

#define L (VX_VEC_BYTES / 4) /* int32 lanes: output features per panel */
/* k-quads whose weights stay in registers while a tile of rows passes over them (CQ), and rows per tile (MT): the
 * accumulators (float and int32 per row), the weights, a scale and a zero fit 32 vector registers with AVX-512
 * (8 + 8 + 4 + 2 + temporaries) and 16 with AVX2 (3 + 6 + 4 + 2). Measured on the AVX-512 EPYC (one thread, 4-bit
 * 576x576 and 3072x576, M 1-128): MT 8 with CQ 4 beat CQ 8 (which spills) by 5-15% from M 8 up, and MT 4, 6,
 * 10, 12 or 16 (with CQ 2) by 0-15%; all were within noise at M 1-4. Overridable (-DMT= -DCQ=) to measure again. */
#ifndef MT
#define MT (VX_VEC_BYTES == 64 ? 8 : 3)
#endif
#ifndef CQ
#define CQ 4
#endif

typedef float vf __attribute__((vector_size(VX_VEC_BYTES)));
typedef int32_t vi __attribute__((vector_size(VX_VEC_BYTES)));
typedef uint32_t vu __attribute__((vector_size(VX_VEC_BYTES)));

AI vi loadi(const void *p) {
    vi v;
    memcpy(&v, p, sizeof v);
    return v;
}
AI vf loadf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
AI void storef(float *p, vf v) { memcpy(p, &v, sizeof v); }
AI vf bcastf(float s) { return s - (vf){0}; }
AI vi bcast4(const int8_t *p) { /* the four int8 of x at p, in every lane */
    int32_t s;
    memcpy(&s, p, sizeof s);
    return s + (vi){0};
}

#if VX_VEC_BYTES == 64
AI vf load_h(const uint16_t *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#else
AI vf load_h(const uint16_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif
AI vf load_sz(const void *sz, int64_t i, const int half) {
    return half ? load_h((const uint16_t *)sz + i) : loadf((const float *)sz + i);
}

/* acc + the sums of four products w (unsigned bytes) * x (signed bytes) in each int32 lane. */
AI vi dot4(vi acc, vi w, vi x) {
#if VX_VEC_BYTES == 64 && DOT_VNNI
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)x);
#elif DOT_VNNI && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (vi)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)w, (__m256i)x);
#elif DOT_VNNI
    return (vi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, (__m256i)x);
#else /* 4-bit weights: |pair sum| <= 2 * 15 * 127, no saturation */
    const __m256i pairs = _mm256_maddubs_epi16((__m256i)w, (__m256i)x);
    return acc + (vi)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

/* The weights of k-quad `t` of a panel: one vector of L lanes x 4 bytes. */
AI vi quad(const uint8_t *panel, int64_t t, const int bits) {
    if (bits == 8) return loadi(panel + t * VX_VEC_BYTES);
    const vu b = (vu)loadi(panel + (t >> 1) * VX_VEC_BYTES), m = (vu){0} + 0x0F0F0F0Fu;
    return (vi)((t & 1) ? (b >> 4) & m : b & m);
}

/* Int32 accumulators per row: two (even and odd quads) for a tile of few rows, so that one row still runs two
 * dot-product chains at once; one for more rows, which give independent chains anyway and need the registers. */
#define U(R) ((R) <= 3 ? 2 : 1)

/* Rows' int32 accumulators += the products of NQ k-quads from quad t0 (NQ even: whole 4-bit bytes). */
AI void chunk(const int8_t *xq, int64_t K, const int R, const uint8_t *panel, int64_t t0, const int NQ, const int bits,
              vi *ia) {
    vi w[CQ];
    for (int j = 0; j < NQ; j++) w[j] = quad(panel, t0 + j, bits);
    for (int m = 0; m < R; m++)
        for (int j = 0; j < NQ; j++) {
            vi *a = &ia[m * U(R) + j % U(R)];
            *a = dot4(*a, w[j], bcast4(xq + m * K + (t0 + j) * 4));
        }
}

/* y[R rows, L features of one panel] = the rows' product with the panel over all of K. */
AI void tile(const int8_t *xq, const float *xd, const float *xc, int64_t K, int64_t G, const int R,
             const uint8_t *panel, const void *sz, const int bits, const int half, float *y, int64_t ldy,
             int64_t valid) {
    const int64_t ng = K / G, gq = G / 4;
    vf acc[MT];
    for (int m = 0; m < R; m++) acc[m] = (vf){0};
    for (int64_t g = 0; g < ng; g++) {
        const vf s = load_sz(sz, g * 2 * L, half), z0 = load_sz(sz, g * 2 * L + L, half);
        const vf z = bits == 8 ? z0 - 128.0f * s : z0;
        vi ia[2 * MT + 1];
        for (int m = 0; m < U(R) * R; m++) ia[m] = (vi){0};
        int64_t t = g * gq;
        const int64_t end = t + gq;
        for (; t + CQ <= end; t += CQ) chunk(xq, K, R, panel, t, CQ, bits, ia);
        switch (end - t) { /* a group of G % (4 * CQ) != 0 k: the rest (even, since G % 8 == 0) */
            case 2: chunk(xq, K, R, panel, t, 2, bits, ia); break;
#if CQ > 4
            case 4: chunk(xq, K, R, panel, t, 4, bits, ia); break;
            case 6: chunk(xq, K, R, panel, t, 6, bits, ia); break;
#endif
            default: break;
        }
        for (int m = 0; m < R; m++) {
            const vi d = U(R) == 2 ? ia[2 * m] + ia[2 * m + 1] : ia[m];
            const vf dot = __builtin_convertvector(d, vf);
            acc[m] += (dot * bcastf(xd[m * ng + g])) * s + z * bcastf(xc[m * ng + g]);
        }
    }
    for (int m = 0; m < R; m++) {
        if (valid == L) {
            storef(y + m * ldy, acc[m]);
        } else {
            float t[L];
            storef(t, acc[m]);
            for (int64_t j = 0; j < valid; j++) y[m * ldy + j] = t[j];
        }
    }
}

AI void one_panel(const int8_t *xq, const float *xd, const float *xc, int64_t M, int64_t K, int64_t G,
                  const uint8_t *panel, const void *sz, const int bits, const int half, float *y, int64_t ldy,
                  int64_t valid) {
    const int64_t ng = K / G;
    int64_t m = 0;
    for (; m + MT <= M; m += MT)
        tile(xq + m * K, xd + m * ng, xc + m * ng, K, G, MT, panel, sz, bits, half, y + m * ldy, ldy, valid);
    switch (M - m) { /* the last rows, as one tile of their exact count (constant R in each) */
#define TAIL(r)                                                                                          \
    case r: tile(xq + m * K, xd + m * ng, xc + m * ng, K, G, r, panel, sz, bits, half, y + m * ldy, ldy, valid); \
        break;
        TAIL(1) TAIL(2)
#if MT > 3
        TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
#endif
#if MT > 8
        TAIL(8) TAIL(9) TAIL(10) TAIL(11)
#endif
#if MT > 12
        TAIL(12) TAIL(13) TAIL(14) TAIL(15)
#endif
#undef TAIL
        default: break;
    }
}

/* One row of x to int8 per group of G (G % 8 == 0): xq, dx (the step) and c = dx * sum(xq) per group. */
static void quantize_row(const float *x, int64_t K, int64_t G, int8_t *xq, float *xd, float *xc) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t g = 0; g * G < K; g++) {
        const float *xg = x + g * G;
        __m256 mx = _mm256_setzero_ps();
        for (int64_t k = 0; k < G; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xg + k), abs_mask));
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, mx);
        for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i sum = _mm256_setzero_si256();
        for (int64_t k = 0; k < G; k += 8) {
            /* cvtps rounds to nearest (even) in the default rounding mode; |x * inv| <= 127 up to rounding */
            const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + k), vinv));
            sum = _mm256_add_epi32(sum, q);
            const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            _mm_storel_epi64((__m128i *)(xq + g * G + k), _mm_packs_epi16(w16, w16));
        }
        int32_t s[8], total = 0;
        _mm256_storeu_si256((__m256i *)s, sum);
        for (int i = 0; i < 8; i++) total += s[i];
        xd[g] = amax / 127.0f;
        xc[g] = xd[g] * (float)total;
    }
}

/* Which weight bit widths this build serves (bit 4 and/or bit 8 set), and whether its dot product is VNNI. */
int vx_i8_support(void) { return SUPPORT; }
int vx_i8_vnni(void) { return DOT_VNNI; }
/* The panel width (output features) of the layout above. */
int vx_i8_panel(void) { return L; }

/* y[M, N] = x[M, K] @ W^T for a weight in the layout above; returns 0, or -1 for bad sizes or an unserved width,
 * -2 when the activations' scratch cannot be allocated. One OpenMP team: rows are quantized, then panels split. */
int vx_i8_matmul_f32(const float *x, int64_t M, int64_t K, const uint8_t *q, int bits, const void *sz, int sz_half,
                     int64_t N, int64_t G, float *y, int nthreads) {
    if (M < 0 || N < 0 || K <= 0 || G <= 0 || G % 8 || K % G || (bits != 4 && bits != 8) || !(SUPPORT & (1 << bits)))
        return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t ng = K / G, panels = (N + L - 1) / L, panel_bytes = K * L * bits / 8;
    const int64_t sz_panel = ng * 2 * L * (sz_half ? 2 : 4);
    char *scratch = malloc(M * K + 2 * M * ng * sizeof(float));
    if (!scratch) return -2;
    float *xd = (float *)scratch, *xc = xd + M * ng;
    int8_t *xq = (int8_t *)(xc + M * ng);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, G, xq + m * K, xd + m * ng, xc + m * ng);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t valid = N - p * L < L ? N - p * L : L;
            const uint8_t *panel = q + p * panel_bytes, *psz = (const uint8_t *)sz + p * sz_panel;
            /* constant `bits` and `half` in each call, so the inlined code is specialised for them */
            if (bits == 4 && sz_half) one_panel(xq, xd, xc, M, K, G, panel, psz, 4, 1, y + p * L, N, valid);
            else if (bits == 4) one_panel(xq, xd, xc, M, K, G, panel, psz, 4, 0, y + p * L, N, valid);
#if SUPPORT & (1 << 8)
            else if (sz_half) one_panel(xq, xd, xc, M, K, G, panel, psz, 8, 1, y + p * L, N, valid);
            else one_panel(xq, xd, xc, M, K, G, panel, psz, 8, 0, y + p * L, N, valid);
#endif
        }
    }
    free(scratch);
    return 0;
}
#else /* no AVX2: this build serves nothing (vx_i8_support() == 0) and quant_matmul.c takes every weight */
int vx_i8_support(void) { return 0; }
int vx_i8_vnni(void) { return 0; }
int vx_i8_panel(void) { return 0; }
int vx_i8_matmul_f32(const float *x, int64_t M, int64_t K, const uint8_t *q, int bits, const void *sz, int sz_half,
                     int64_t N, int64_t G, float *y, int nthreads) {
    return -1;
}
#endif
