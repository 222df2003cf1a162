/* Weight-only integer matmuls on the CPU: y[M, N] = x[M, K] @ W^T with W stored as 4-bit or 8-bit integers and an
 * affine (scale, zero) per output feature and group of G input features: W[n, k] = q[n, k] * s[n, k / G] + z[n, k / G].
 * The weight is dequantized in registers (or, for many rows of x, into a small per-thread tile), never into a float
 * copy of the whole weight, and activations stay float32 (x and y are float32; the caller converts bf16/fp16).
 *
 * Layout (packed once at load by vx/kernels/quant_matmul.py). Output features come in panels of P = 2 * VW (two
 * vectors of VW floats); a panel is stored k-major, so that one k gives two vectors of P weights and the
 * arithmetic runs along n (no horizontal sums, any K and any group size):
 *   int4:  q4[panel][k][VW] bytes; byte j holds q[n0 + j] in its low nibble and q[n0 + VW + j] in its high one
 *   int8:  q8[panel][k][P] int8
 *   sz:    [panel][group][2][P] float32 or float16: the scales of the panel's P features, then their zeros
 *          (float16 when every scale and zero is exactly a float16, as GGUF's Q4_0/Q4_1/Q8_0 ones are: the
 *          weight streams ~20% fewer bytes at 4 bits, and the products are the same)
 * N is padded to a whole panel with zero weights; y has exactly N columns (ldy = N).
 *
 * Vector width: AVX-512 (VW = 16) or AVX2 (VW = 8) with -march=native; any width elsewhere through GCC's
 * generic vectors. VX_VEC_BYTES may be set to build another width on the same machine (the tests run the
 * 16-wide layout on an AVX2 machine this way).
 */
#include <stdint.h>
#include <string.h>

#ifndef VX_VEC_BYTES
#if defined(__AVX512F__)
#define VX_VEC_BYTES 64
#elif defined(__AVX2__)
#define VX_VEC_BYTES 32
#else
#define VX_VEC_BYTES 16
#endif
#endif
#define VW (VX_VEC_BYTES / 4) /* floats per vector */
#define P (2 * VW)            /* output features per panel */
#define KB 256                /* k per dequantized tile: P * KB floats stay in L1 */
#define AI static inline __attribute__((always_inline))

/* Rows of x per register tile: the accumulators (2 * MB vectors) plus the two weight vectors, the broadcast x
 * and (direct path) four scale/zero vectors must fit the register file: 16 vector registers with AVX2, 32 with
 * AVX-512. The direct path dequantizes in registers for every tile of rows, so it serves few rows; above
 * MB_DIRECT rows the panel is dequantized once per k-tile into a buffer that every row tile reuses. */
#if VX_VEC_BYTES == 64
#define MB_DIRECT 8
#define MB_TILE 12
#else
#define MB_DIRECT 4
#define MB_TILE 6
#endif

typedef float vf __attribute__((vector_size(VX_VEC_BYTES)));

AI vf loadf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
AI void storef(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* VW scales or zeros from `sz` at element `i`: float32, or float16 widened (exactly). */
#if VX_VEC_BYTES == 64 && defined(__AVX512F__)
#include <immintrin.h>
AI vf load_h(const uint16_t *p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif VX_VEC_BYTES == 32 && defined(__F16C__)
#include <immintrin.h>
AI vf load_h(const uint16_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
AI vf load_h(const uint16_t *p) {
    vf v;
    for (int i = 0; i < VW; i++) {
        _Float16 h;
        memcpy(&h, p + i, sizeof h);
        v[i] = (float)h;
    }
    return v;
}
#endif
AI vf load_sz(const void *sz, int64_t i, const int half) {
    return half ? load_h((const uint16_t *)sz + i) : loadf((const float *)sz + i);
}
/* A splat (one vbroadcastss). s - 0 is s exactly, so it folds away; 0 + s would not (-0.0), nor would a loop of
 * element stores, which GCC builds element by element. */
AI vf bcast(float s) { return s - (vf){0}; }

/* Integers to floats: GCC's generic conversion of narrow vectors goes element by element, so the ISA's widening
 * conversions are spelled out where they exist. */
#if VX_VEC_BYTES == 64 && defined(__AVX512F__)
#include <immintrin.h>
AI void cvt_q4(const uint8_t *p, vf *lo, vf *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    *lo = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m)));
    *hi = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
}
AI vf cvt_q8(const int8_t *p) { return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
#elif VX_VEC_BYTES == 32 && defined(__AVX2__)
#include <immintrin.h>
AI void cvt_q4(const uint8_t *p, vf *lo, vf *hi) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p), m = _mm_set1_epi8(15);
    *lo = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, m)));
    *hi = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
}
AI vf cvt_q8(const int8_t *p) { return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
#else
AI void cvt_q4(const uint8_t *p, vf *lo, vf *hi) {
    for (int i = 0; i < VW; i++) {
        (*lo)[i] = (float)(p[i] & 15);
        (*hi)[i] = (float)(p[i] >> 4);
    }
}
AI vf cvt_q8(const int8_t *p) {
    vf v;
    for (int i = 0; i < VW; i++) v[i] = (float)p[i];
    return v;
}
#endif

/* The P weights of one k of a panel, dequantized: w = q * s + z. */
AI void dequant(const void *panel, int64_t k, const int bits, vf s0, vf s1, vf z0, vf z1, vf *w0, vf *w1) {
    vf q0, q1;
    if (bits == 4) {
        cvt_q4((const uint8_t *)panel + k * VW, &q0, &q1);
    } else {
        q0 = cvt_q8((const int8_t *)panel + k * P);
        q1 = cvt_q8((const int8_t *)panel + k * P + VW);
    }
    *w0 = q0 * s0 + z0;
    *w1 = q1 * s1 + z1;
}

/* Write (or add) a row tile's accumulators to y[m, n0 .. n0 + valid). */
AI void put(float *y, vf a0, vf a1, int64_t valid, int add) {
    if (valid == P) {
        if (add) {
            a0 += loadf(y);
            a1 += loadf(y + VW);
        }
        storef(y, a0);
        storef(y + VW, a1);
        return;
    }
    float t[P];
    storef(t, a0);
    storef(t + VW, a1);
    for (int64_t j = 0; j < valid; j++) y[j] = add ? y[j] + t[j] : t[j];
}

/* Few rows of x: dequantize in registers as the panel streams by, all of K in one pass. Each (row, vector)
 * accumulates into U independent sums (consecutive k go to different ones), so that about eight FMA chains run
 * at once: one or two rows would otherwise wait on the FMA latency at every k. */
AI void panel_direct(const float *x, int64_t K, const int MB, const void *panel, const void *sz, int64_t G,
                     const int bits, const int half, float *y, int64_t ldy, int64_t valid) {
    enum { UMAX = 4 };
    const int U = MB == 1 ? 4 : MB == 2 ? 2 : 1; /* 8 accumulators at most: with MB = 3, U = 2 would spill */
    vf acc[MB_DIRECT][2][UMAX];
    for (int m = 0; m < MB; m++)
        for (int u = 0; u < U; u++) acc[m][0][u] = acc[m][1][u] = (vf){0};
    for (int64_t g = 0; g * G < K; g++) {
        const int64_t gs = g * 2 * P;
        const vf s0 = load_sz(sz, gs, half), s1 = load_sz(sz, gs + VW, half), z0 = load_sz(sz, gs + P, half),
                 z1 = load_sz(sz, gs + P + VW, half);
        const int64_t end = (g + 1) * G;
        int64_t k = g * G;
        for (; k + U <= end; k += U) {
            for (int u = 0; u < U; u++) {
                vf w0, w1;
                dequant(panel, k + u, bits, s0, s1, z0, z1, &w0, &w1);
                for (int m = 0; m < MB; m++) {
                    const vf xb = bcast(x[m * K + k + u]);
                    acc[m][0][u] += w0 * xb;
                    acc[m][1][u] += w1 * xb;
                }
            }
        }
        for (; k < end; k++) { /* a group size that U does not divide */
            vf w0, w1;
            dequant(panel, k, bits, s0, s1, z0, z1, &w0, &w1);
            for (int m = 0; m < MB; m++) {
                const vf xb = bcast(x[m * K + k]);
                acc[m][0][0] += w0 * xb;
                acc[m][1][0] += w1 * xb;
            }
        }
    }
    for (int m = 0; m < MB; m++) {
        for (int u = 1; u < U; u++) {
            acc[m][0][0] += acc[m][0][u];
            acc[m][1][0] += acc[m][1][u];
        }
        put(y + m * ldy, acc[m][0][0], acc[m][1][0], valid, 0);
    }
}

/* Many rows: the row tile's product with a dequantized k-tile buf[k - k0][P], added to y unless first. */
AI void tile_rows(const float *x, int64_t K, const int MB, const float *buf, int64_t k0, int64_t k1, float *y,
                  int64_t ldy, int64_t valid, int first) {
    vf acc[MB_TILE][2];
    for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = (vf){0};
    for (int64_t k = k0; k < k1; k++) {
        const vf w0 = loadf(buf + (k - k0) * P), w1 = loadf(buf + (k - k0) * P + VW);
        for (int m = 0; m < MB; m++) {
            const vf xb = bcast(x[m * K + k]);
            acc[m][0] += w0 * xb;
            acc[m][1] += w1 * xb;
        }
    }
    for (int m = 0; m < MB; m++) put(y + m * ldy, acc[m][0], acc[m][1], valid, !first);
}

AI void panel_tiled(const float *x, int64_t M, int64_t K, const void *panel, const void *sz, int64_t G,
                    const int bits, const int half, float *y, int64_t ldy, int64_t valid) {
    float buf[KB * P] __attribute__((aligned(64)));
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = K - k0 < KB ? K : k0 + KB;
        for (int64_t k = k0; k < k1;) { /* dequantize [k0, k1), one group's span at a time */
            const int64_t g = k / G, end = (g + 1) * G < k1 ? (g + 1) * G : k1;
            const int64_t gs = g * 2 * P;
            const vf s0 = load_sz(sz, gs, half), s1 = load_sz(sz, gs + VW, half), z0 = load_sz(sz, gs + P, half),
                     z1 = load_sz(sz, gs + P + VW, half);
            for (; k < end; k++) {
                vf w0, w1;
                dequant(panel, k, bits, s0, s1, z0, z1, &w0, &w1);
                storef(buf + (k - k0) * P, w0);
                storef(buf + (k - k0) * P + VW, w1);
            }
        }
        int64_t m = 0;
        for (; m + MB_TILE <= M; m += MB_TILE)
            tile_rows(x + m * K, K, MB_TILE, buf, k0, k1, y + m * ldy, ldy, valid, k0 == 0);
        /* The last rows: one tile of the exact count, so the compiler sees a constant MB in each. */
        switch (M - m) {
#define TAIL(r) case r: tile_rows(x + m * K, K, r, buf, k0, k1, y + m * ldy, ldy, valid, k0 == 0); break;
            TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5)
#if MB_TILE > 6
            TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11)
#endif
#undef TAIL
            default: break;
        }
    }
}

AI void one_panel(const float *x, int64_t M, int64_t K, const void *panel, const void *sz, int64_t G,
                  const int bits, const int half, float *y, int64_t ldy, int64_t valid) {
    if (M > MB_DIRECT) {
        panel_tiled(x, M, K, panel, sz, G, bits, half, y, ldy, valid);
        return;
    }
    switch (M) {
#define DIRECT(r) case r: panel_direct(x, K, r, panel, sz, G, bits, half, y, ldy, valid); break;
        DIRECT(1) DIRECT(2) DIRECT(3) DIRECT(4)
#if MB_DIRECT > 4
        DIRECT(5) DIRECT(6) DIRECT(7) DIRECT(8)
#endif
#undef DIRECT
        default: break;
    }
}

static int check(int64_t M, int64_t K, int64_t N, int64_t G) {
    return M >= 0 && N >= 0 && K > 0 && G > 0 && K % G == 0 ? 0 : -1;
}

/* The panel width the layout above was packed for (2 * the vector width of this build). */
int vx_quant_panel(void) { return P; }

/* y[M, N] = x[M, K] @ W^T over the packed panels of `q` (`panel_bytes` each, `bits` 4 or 8), scales and zeros in
 * float16 when `half`: OpenMP over panels. */
static int matmul_panels(const float *x, int64_t M, int64_t K, const uint8_t *q, int64_t panel_bytes, int bits,
                         const void *sz, int half, int64_t N, int64_t G, float *y, int nthreads) {
    if (check(M, K, N, G)) return -1;
    const int64_t panels = (N + P - 1) / P, ng = K / G, sz_bytes = half ? 2 : 4;
    const uint8_t *szb = (const uint8_t *)sz;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t valid = N - p * P < P ? N - p * P : P;
        const uint8_t *panel = q + p * panel_bytes, *psz = szb + p * ng * 2 * P * sz_bytes;
        /* Each call with constant `bits` and `half`, so that the inlined panel code is specialised for them. */
        if (bits == 4 && half) one_panel(x, M, K, panel, psz, G, 4, 1, y + p * P, N, valid);
        else if (bits == 4) one_panel(x, M, K, panel, psz, G, 4, 0, y + p * P, N, valid);
        else if (half) one_panel(x, M, K, panel, psz, G, 8, 1, y + p * P, N, valid);
        else one_panel(x, M, K, panel, psz, G, 8, 0, y + p * P, N, valid);
    }
    return 0;
}

/* y[M, N] = x[M, K] @ W^T for int4 weights q4 (see the layout above); returns 0, or -1 for bad sizes. */
int vx_q4_matmul_f32(const float *x, int64_t M, int64_t K, const uint8_t *q4, const void *sz, int sz_half,
                     int64_t N, int64_t G, float *y, int nthreads) {
    return matmul_panels(x, M, K, q4, K * VW, 4, sz, sz_half, N, G, y, nthreads);
}

/* The same for int8 weights q8. */
int vx_q8_matmul_f32(const float *x, int64_t M, int64_t K, const int8_t *q8, const void *sz, int sz_half,
                     int64_t N, int64_t G, float *y, int nthreads) {
    return matmul_panels(x, M, K, (const uint8_t *)q8, K * P, 8, sz, sz_half, N, G, y, nthreads);
}
