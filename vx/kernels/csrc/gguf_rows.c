/* GGUF Q4_K and Q6_K weights as stored times several rows of x (a decode step of many requests, a prefill): y[m, n]
 * = sum_k x[m, k] * W[n, k], x rounded to int8 per block of 256 exactly as csrc/gguf_kquant.c rounds it.
 *
 * The as-stored kernel's lanes run along k, so each sub-block's scale costs it a second instruction per 64 products
 * (maddubs, then a multiply-add with the scale). Here the lanes run along n instead, as in the repacked int8 kernel
 * (quant_matmul_i8.c): each block of 16 weight rows is decoded once per call into L1, transposed so that int32
 * lane i holds four consecutive weights of row i, and every row of x then multiplies it with one vpdpbusd per 64
 * products (x's four bytes broadcast). A sub-block's (Q4_K, 32 weights) or group's (Q6_K, 16) integer sum takes its
 * scale as one int32 multiply per lane; the minimums (Q4_K) and the -32 offset (Q6_K) are pairs of int16 per lane
 * against pairs of x's sums (vpdpwssd). Each block's integer sums become float once:
 *   Q4_K  y += float(sum_j sc[j] dot_j) * (d dx) - float(sum_j m[j] xsum_j) * (dmin dx)
 *   Q6_K  y += float(sum_g sc[g] (dot_g - 32 xsum_g)) * (d dx)
 * one lane per (row of x, weight row), blocks in order: a row's product depends on that row alone, whatever the
 * number of rows, their order or the threads (which split the weight's rows).
 *
 * AVX-512 VNNI only (16 lanes); other builds serve no type (`vx_gguf_rows_types` 0) and keep the other ways.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))

enum { T_Q4_K = 12, T_Q6_K = 14 };

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__)

/* Weight rows per panel: one per int32 lane. */
#define L 16
/* Rows of x per tile: two int32 accumulators each (a group's sum and the block's) beside a weight vector in the 32
 * vector registers; 8 measured as fast as 12 for Q4_K and faster for Q6_K (AVX-512 EPYC, one thread, 1.7B gate and
 * down shapes, 16 and 64 rows). Overridable (-DMT=, up to 12) to measure again. */
#ifndef MT
#define MT 8
#endif
/* Bytes of int8 x per chunk of rows kept in the cache while the weight's panels pass over them. */
#define X_CHUNK_BYTES (512 * 1024)
/* Blocks ahead that each of a panel's 16 rows is prefetched (more streams than the hardware prefetcher follows):
 * 4 measured faster than 1 or 2 for one row of x, equal with 16 (AVX-512 EPYC, one thread, 1.7B gate shape). */
#ifndef PD
#define PD 4
#endif

/* One block (256 weights) of a panel's 16 rows, decoded: q[t] lane i = row i's weights 4t..4t+3 (unsigned bytes:
 * Q4_K 0..15, Q6_K 0..63); sc[g] the int32 scale of group g (Q4_K's 8 sub-blocks, Q6_K's 16 groups); pe / po the
 * int16 pairs against x's pair sums (Q4_K: minimums (m0, m2), (m1, m3), (m4, m6), (m5, m7); Q6_K: -32 sc for
 * groups (4c, 4c + 2) and (4c + 1, 4c + 3)); d, dm each row's float scales (dm: Q4_K's dmin). */
typedef struct {
    __m512i q[64];
    __m512i sc[16];
    __m512i pe[4], po[4];
    __m512 d, dm;
} panel_block;

/* 16 vectors of 16 dwords, transposed: r[u] lane i becomes the old r[i] lane u. */
AI void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* r[4a + c], 128-bit lane l: rows 4a..4a + 3's dword 4l + c */
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), u1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
        const __m512i v0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
        const __m512i v1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
        t[c] = _mm512_shuffle_i32x4(u0, v0, 0x88), t[8 + c] = _mm512_shuffle_i32x4(u0, v0, 0xdd);
        t[4 + c] = _mm512_shuffle_i32x4(u1, v1, 0x88), t[12 + c] = _mm512_shuffle_i32x4(u1, v1, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* The 16 bytes at rows[i] + at, for the 16 rows, as 4 vectors: s[c] lane i = row i's dword c. */
AI void gather16(const uint8_t *const *rows, int at, __m512i *s) {
    __m512i z[4];
    for (int a = 0; a < 4; a++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rows[4 * a] + at)));
        for (int l = 1; l < 4; l++) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[4 * a + l] + at)), l);
        z[a] = v;
    }
    for (int c = 0; c < 4; c++) {
        const __m512i idx = _mm512_set_epi32(28 + c, 24 + c, 20 + c, 16 + c, 12 + c, 8 + c, 4 + c, c,
                                             28 + c, 24 + c, 20 + c, 16 + c, 12 + c, 8 + c, 4 + c, c);
        const __m512i lo = _mm512_permutex2var_epi32(z[0], idx, z[1]), hi = _mm512_permutex2var_epi32(z[2], idx, z[3]);
        s[c] = _mm512_shuffle_i64x2(lo, hi, 0x44);
    }
}

AI __m512i bytes(uint32_t v) { return _mm512_set1_epi32((int)v); }

/* Q4_K block at rows[i] (144 bytes: f16 d, f16 dmin, 12 bytes of scales and minimums, 128 of nibbles). */
AI void decode_q4_k(const uint8_t *const *rows, panel_block *pb) {
    const __m512i low = bytes(0x0f0f0f0fu);
    for (int c = 0; c < 2; c++) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(rows[i] + 16 + 64 * c);
        transpose16(r);
        /* r[u]: run j = 2c + u / 8 (sub-blocks 2j in the low nibbles, 2j + 1 in the high), bytes 4 (u % 8).. */
        for (int u = 0; u < 16; u++) {
            const int t = 32 * c + 16 * (u / 8) + u % 8;
            pb->q[t] = _mm512_and_si512(r[u], low);
            pb->q[t + 8] = _mm512_and_si512(_mm512_srli_epi16(r[u], 4), low);
        }
    }
    __m512i s[4]; /* d | dmin, then bytes 0-3, 4-7, 8-11 of the scales (see gguf_kquant.c's k_scales) */
    gather16(rows, 0, s);
    pb->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(s[0]));
    pb->dm = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(s[0], 16)));
    const __m512i low6 = bytes(0x3f3f3f3fu), top2 = bytes(0x30303030u), a = s[1], m = s[2], c = s[3];
    const __m512i sl = _mm512_and_si512(a, low6);
    const __m512i sh = _mm512_or_si512(_mm512_and_si512(c, low), _mm512_and_si512(_mm512_srli_epi32(a, 2), top2));
    const __m512i ml = _mm512_and_si512(m, low6);
    const __m512i mh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(c, 4), low),
                                       _mm512_and_si512(_mm512_srli_epi32(m, 2), top2));
    const __m512i byte = _mm512_set1_epi32(0xff), even = _mm512_set1_epi32(0x00ff00ff);
    for (int j = 0; j < 4; j++) {
        pb->sc[j] = _mm512_and_si512(_mm512_srli_epi32(sl, 8 * j), byte);
        pb->sc[4 + j] = _mm512_and_si512(_mm512_srli_epi32(sh, 8 * j), byte);
    }
    pb->pe[0] = _mm512_and_si512(ml, even), pb->po[0] = _mm512_srli_epi16(ml, 8);
    pb->pe[1] = _mm512_and_si512(mh, even), pb->po[1] = _mm512_srli_epi16(mh, 8);
}

/* Q6_K block at rows[i] (210 bytes: 128 of low nibbles, 64 of high bit pairs, int8 sc[16], f16 d). */
AI void decode_q6_k(const uint8_t *const *rows, panel_block *pb) {
    const __m512i low = bytes(0x0f0f0f0fu), two = bytes(0x30303030u);
    __m512i qh[16];
    for (int i = 0; i < 16; i++) qh[i] = _mm512_loadu_si512(rows[i] + 128);
    transpose16(qh); /* qh[8h + u]: half h's high pairs, bytes 4u.. */
    for (int h = 0; h < 2; h++) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(rows[i] + 64 * h);
        transpose16(r); /* r[u]: bytes 4u.. of the half's first 32 (a), r[8 + u] of its next 32 (c) */
        for (int u = 0; u < 8; u++) {
            /* weights 128h + 32i + 4u.. (quad 32h + 8i + u): a's low nibbles with bits 0-1 of qh, c's with 2-3,
             * a's high nibbles with 4-5, c's with 6-7 */
            const __m512i a = r[u], c = r[8 + u], hb = qh[8 * h + u];
            __m512i *q = pb->q + 32 * h + u;
            q[0] = _mm512_or_si512(_mm512_and_si512(a, low), _mm512_and_si512(_mm512_slli_epi16(hb, 4), two));
            q[8] = _mm512_or_si512(_mm512_and_si512(c, low), _mm512_and_si512(_mm512_slli_epi16(hb, 2), two));
            q[16] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), low), _mm512_and_si512(hb, two));
            q[24] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(c, 4), low),
                                    _mm512_and_si512(_mm512_srli_epi16(hb, 2), two));
        }
    }
    __m512i s[4]; /* s[c]: sc[4c..4c + 3] */
    gather16(rows, 192, s);
    const __m512i minus32 = _mm512_set1_epi16(-32);
    for (int c = 0; c < 4; c++) {
        for (int e = 0; e < 4; e++) pb->sc[4 * c + e] = _mm512_srai_epi32(_mm512_slli_epi32(s[c], 24 - 8 * e), 24);
        pb->pe[c] = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(s[c], 8), 8), minus32);
        pb->po[c] = _mm512_mullo_epi16(_mm512_srai_epi16(s[c], 8), minus32);
    }
    uint16_t d[16];
    for (int i = 0; i < 16; i++) memcpy(&d[i], rows[i] + 208, 2);
    pb->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d));
    pb->dm = _mm512_setzero_ps();
}

/* x's int8 form: q [M][K]; d [M][K / 256]; p [M][K / 256][NP] the int16 pairs of sums (see panel_block). */
typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *p;
    int64_t K, NP;
} xrows;

AI __m512i bcast(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* acc[r][16] (float, one lane per weight row) += rows m0..m0 + R of x times block b of the panel. */
AI void tile(const int type, const panel_block *pb, const xrows *x, int64_t m0, int64_t b, const int R, float *acc,
             const int first) {
    const int groups = type == T_Q4_K ? 8 : 16, gq = 64 / groups; /* quads per group */
    __m512i ia[MT], t[MT];
    for (int r = 0; r < R; r++) ia[r] = _mm512_setzero_si512();
    for (int g = 0; g < groups; g++) {
        /* unrolled: a loop here would move each accumulator between registers after every product */
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) t[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int u = 0; u < gq; u++) {
            const __m512i w = pb->q[g * gq + u];
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
                t[r] = _mm512_dpbusd_epi32(t[r], w, bcast(x->q + (m0 + r) * x->K + b * 256 + 4 * (g * gq + u)));
        }
        for (int r = 0; r < R; r++) ia[r] = _mm512_add_epi32(ia[r], _mm512_mullo_epi32(t[r], pb->sc[g]));
    }
    for (int r = 0; r < R; r++) {
        const int32_t *xp = x->p + ((m0 + r) * (x->K / 256) + b) * x->NP;
        const __m512 dx = _mm512_set1_ps(x->d[(m0 + r) * (x->K / 256) + b]);
        __m512 a = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + 16 * r);
        if (type == T_Q4_K) {
            __m512i mm = _mm512_dpwssd_epi32(_mm512_setzero_si512(), pb->pe[0], bcast(xp));
            mm = _mm512_dpwssd_epi32(mm, pb->po[0], bcast(xp + 1));
            mm = _mm512_dpwssd_epi32(mm, pb->pe[1], bcast(xp + 2));
            mm = _mm512_dpwssd_epi32(mm, pb->po[1], bcast(xp + 3));
            a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), _mm512_mul_ps(pb->d, dx), a);
            a = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mm), _mm512_mul_ps(pb->dm, dx), a);
        } else {
            __m512i s = ia[r];
            for (int c = 0; c < 4; c++) {
                s = _mm512_dpwssd_epi32(s, pb->pe[c], bcast(xp + 2 * c));
                s = _mm512_dpwssd_epi32(s, pb->po[c], bcast(xp + 2 * c + 1));
            }
            a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(pb->d, dx), a);
        }
        _mm512_storeu_ps(acc + 16 * r, a);
    }
}

/* Rows m0..m0 + rows of x times block b of the panel, in tiles of MT (the last one of its exact count). */
AI void tiles(const int type, const panel_block *pb, const xrows *x, int64_t m0, int64_t rows, int64_t b, float *acc) {
    const int first = b == 0;
    int64_t m = 0;
    for (; m + MT <= rows; m += MT) tile(type, pb, x, m0 + m, b, MT, acc + 16 * m, first);
    switch (rows - m) {
#define TAIL(R) case R: tile(type, pb, x, m0 + m, b, R, acc + 16 * m, first); break;
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
#if MT > 8
        TAIL(8) TAIL(9) TAIL(10) TAIL(11)
#endif
#undef TAIL
        default: break;
    }
}

/* The panel of weight rows n0..n0 + 16 (rows past N repeat row n0; their lanes are not written) times rows m0..m0
 * + rows of x, into y. */
static void panel(const int type, const uint8_t *w, int64_t ldw, int64_t n0, int64_t N, int64_t nb, const xrows *x,
                  int64_t m0, int64_t rows, panel_block *pb, float *acc, float *y, int64_t ldy) {
    const int64_t bw = type == T_Q4_K ? 144 : 210;
    const uint8_t *row[16];
    for (int i = 0; i < 16; i++) row[i] = w + (n0 + i < N ? n0 + i : n0) * ldw;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk[16];
        for (int i = 0; i < 16; i++) blk[i] = row[i] + b * bw;
        /* PD blocks ahead in each row (past its last block, the next panel's) */
        for (int i = 0; i < 16; i++) {
            const uintptr_t ahead = b + PD < nb ? (uintptr_t)blk[i] + PD * bw
                                                : (uintptr_t)row[i] + 16 * ldw + (b + PD - nb) * bw;
            const char *next = (const char *)ahead;
            for (int64_t o = 0; o < bw + 63; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
        }
        if (type == T_Q4_K) {
            decode_q4_k(blk, pb);
            tiles(T_Q4_K, pb, x, m0, rows, b, acc);
        } else {
            decode_q6_k(blk, pb);
            tiles(T_Q6_K, pb, x, m0, rows, b, acc);
        }
    }
    const int64_t valid = N - n0 < 16 ? N - n0 : 16;
    for (int64_t m = 0; m < rows; m++) memcpy(y + (m0 + m) * ldy + n0, acc + 16 * m, valid * sizeof(float));
}

/* One row of x to int8 per block of 256 (as gguf_kquant.c: dx = max |x[block]| / 127, round to nearest), its steps,
 * and the int16 pairs of its sums that `type`'s pe / po take. */
static void quantize_row(const int type, const float *x, int64_t K, int8_t *xq, float *xd, int32_t *xp) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b * 256 < K; b++) {
        const float *xb = x + b * 256;
        __m256 mx = _mm256_setzero_ps();
        for (int64_t k = 0; k < 256; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + k), abs_mask));
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, mx);
        for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        int32_t s16[16];
        for (int64_t k = 0; k < 256; k += 16) {
            const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + k), inv));
            const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + k + 8), inv));
            const __m256i s = _mm256_add_epi32(a, c);
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            t = _mm_hadd_epi32(t, t);
            t = _mm_hadd_epi32(t, t);
            s16[k / 16] = _mm_cvtsi128_si32(t);
            const __m128i lo = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
            const __m128i hi = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
            _mm_storeu_si128((__m128i *)(xq + b * 256 + k), _mm_packs_epi16(lo, hi));
        }
        xd[b] = amax / 127.0f;
        /* sums per group (32 for Q4_K, 16 for Q6_K), paired as (g, g + 2), (g + 1, g + 3) for each 4 groups */
        int32_t s[16];
        const int groups = type == T_Q4_K ? 8 : 16;
        for (int g = 0; g < groups; g++) s[g] = type == T_Q4_K ? s16[2 * g] + s16[2 * g + 1] : s16[g];
        int32_t *p = xp + b * (groups / 2);
        for (int c = 0; c < groups / 4; c++) {
            p[2 * c] = (int32_t)((uint32_t)(uint16_t)s[4 * c] | (uint32_t)(uint16_t)s[4 * c + 2] << 16);
            p[2 * c + 1] = (int32_t)((uint32_t)(uint16_t)s[4 * c + 1] | (uint32_t)(uint16_t)s[4 * c + 3] << 16);
        }
    }
}

int vx_gguf_rows_types(void) { return (1 << T_Q4_K) | (1 << T_Q6_K); }

/* y[M, N] (row stride ldy) = x[M, K] @ W^T for W's N rows of Q4_K or Q6_K blocks, row r at w + r * ldw bytes.
 * Returns 0, -1 for an unserved type or bad sizes, -2 when scratch cannot be allocated. */
int vx_gguf_rows_matmul_f32(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t ldw, int type, int64_t N,
                            float *y, int64_t ldy, int nthreads) {
    if ((type != T_Q4_K && type != T_Q6_K) || M < 0 || N < 0 || K <= 0 || K % 256) return -1;
    const int64_t nb = K / 256, np = type == T_Q4_K ? 4 : 8;
    if (ldw < nb * (type == T_Q4_K ? 144 : 210) || ldy < N) return -1;
    if (M == 0 || N == 0) return 0;
    int64_t chunk = X_CHUNK_BYTES / K;
    chunk = chunk < MT ? MT : chunk - chunk % MT;
    if (chunk > M) chunk = M;
    char *scratch = malloc(M * nb * (np * sizeof(int32_t) + sizeof(float)) + M * K);
    if (!scratch) return -2;
    int32_t *xp = (int32_t *)scratch;
    float *xd = (float *)(xp + M * nb * np);
    int8_t *xq = (int8_t *)(xd + M * nb);
    const xrows xr = {xq, xd, xp, K, np};
    const int64_t panels = (N + 15) / 16;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(type, x + m * K, K, xq + m * K, xd + m * nb, xp + m * nb * np);
        panel_block *pb = aligned_alloc(64, sizeof(panel_block));
        float *acc = aligned_alloc(64, chunk * 16 * sizeof(float));
        if (!pb || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed)
            for (int64_t m0 = 0; m0 < M; m0 += chunk) {
                const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
#pragma omp for schedule(static)
                for (int64_t p = 0; p < panels; p++)
                    panel(type, w, ldw, 16 * p, N, nb, &xr, m0, rows, pb, acc, y, ldy);
            }
        free(pb);
        free(acc);
    }
    free(scratch);
    return failed ? -2 : 0;
}

#else /* no AVX-512 VNNI: this build serves no type, and products keep the as-stored kernel or the panels */
int vx_gguf_rows_types(void) { return 0; }
int vx_gguf_rows_matmul_f32(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t ldw, int type, int64_t N,
                            float *y, int64_t ldy, int nthreads) {
    return -1;
}
#endif
