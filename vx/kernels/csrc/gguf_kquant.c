/* Matmuls that read GGUF blocks as the file stores them: y[m, n] = sum_k x[m, k] * W[n, k], each row of W a run of
 * GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_XS, Q4_K, Q5_K, Q6_K), with x rounded to int8 first so that the
 * products are integer dot products. No repacking: a decode step reads exactly the file's bytes for its weights.
 *
 * Activations. Each row of x is rounded to int8 per block of QB values (QB = 256 for Q4_K, Q5_K and Q6_K, as
 * llama.cpp's q8_K; 32 for the types with a float scale per 32 weights, as its q8_0): dx = max |x[block]| / 127,
 * xq = round-to-nearest(x / dx), so each element is off by at most dx / 2. The sums of xq per 16 values are kept
 * beside (int16: |sum| <= 16 * 127) for the terms a block's offset or minimum adds (Q4_0's -8, Q5_0's -16, Q4_1's
 * and Q5_1's m, Q4_K's and Q5_K's -dmin * m, Q6_K's -32).
 *
 * Block layouts (GGML's; vx/models/layers/quantization/gguf_blocks.py unpacks the same in torch):
 *   Q8_0 (34 B / 32):  f16 d, int8 q[32]                                   w = d * q
 *   Q4_0 (18 B / 32):  f16 d, byte j holds weight j (low nibble), j + 16 (high)  w = d * (q - 8)
 *   Q4_1 (20 B / 32):  f16 d, f16 m, nibbles as Q4_0                       w = d * q + m
 *   Q5_0 (22 B / 32):  f16 d, 32 bits (bit j: the fifth bit of weight j), nibbles as Q4_0   w = d * (q - 16)
 *   Q5_1 (24 B / 32):  f16 d, f16 m, fifth bits and nibbles as Q5_0        w = d * q + m
 *   IQ4_XS (136 B / 256): f16 d, 16 bits of scales' high pairs, 4 bytes of their low nibbles (6-bit ls[8], 2 bits
 *                      and a nibble each), 8 runs of 16 bytes of nibbles as Q4_0 for sub-block j of 32
 *                      w = d * (ls[i / 32] - 32) * V[q], V a fixed table of 16 int8 values
 *   Q4_K (144 B / 256): f16 d, f16 dmin, 12 bytes of 6-bit scales sc[8] and minimums m[8], 128 bytes: run j
 *                      (32 bytes) holds sub-block 2j in its low nibbles, 2j + 1 in its high ones
 *                      w = d * sc[i / 32] * q - dmin * m[i / 32]
 *   Q5_K (176 B / 256): as Q4_K, with 32 bytes of high bits before the nibbles: bit s of byte l is weight 32 s + l's
 *   Q6_K (210 B / 256): 128 bytes of low nibbles, 64 of high 2-bit pairs, int8 sc[16], f16 d (last)
 *                      w = d * sc[i / 16] * (q - 32)
 * The types with a float scale per 32 weights are one family (tile32, tile32_wide): each is a decode routine
 * (decode32, and decode_pair for two blocks in 512 bits) and a row of FAMILY32; the K types have a tile each (Q4_K
 * and Q5_K one between them, decode_k).
 *
 * Dot products in 256-bit vectors: maddubs (unsigned weight bytes x signed x bytes, pairs summed to int16: no
 * saturation for 6-bit weights, 2 * 63 * 127 < 32767), then the sub-block scale enters as an int16 multiplier of
 * those pairs (VNNI's vpdpwssd where the CPU has it, AVX2's madd + add otherwise) into int32 lanes; each block's
 * int32 sum becomes float once, times d * dx. Signed weights (Q8_0, IQ4_XS's table values) multiply |q| by x with
 * q's sign (vpdpbusd, or maddubs + madd). A build without VNNI (-mno-avx512f -mno-avxvnni) takes the AVX2
 * instructions; one without AVX2 serves nothing.
 *
 * Threads: one OpenMP team quantizes x's rows, then splits the weight's rows; x's rows go in chunks that stay in
 * the cache while every weight row passes over them, a few rows at a time per weight block decoded.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
       T_IQ4_XS = 23 };

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define DOT_VNNI 1
#else
#define DOT_VNNI 0
#endif

/* Q4_K, Q6_K and the types of 32-weight blocks in 512-bit vectors where the CPU has AVX-512 VNNI (half the
 * instructions of the 256-bit code, which Q5_K and AVX2 CPUs take); -DVX_GGUF_256 keeps the 256-bit code everywhere,
 * to compare. */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(VX_GGUF_256)
#define WIDE 1
#else
#define WIDE 0
#endif

/* Rows of x per tile: each weight block is decoded once and multiplied by this many rows. Their int32 and float
 * accumulators stay in registers: 8 rows with AVX-512's 32 vector registers (256-bit ones here), 4 with AVX2's 16.
 * Overridable (-DMT=) to measure again. */
#ifndef MT
#if defined(__AVX512VL__)
#define MT 8
#else
#define MT 4
#endif
#endif
/* Weight rows per call of a type's rows function (the unit threads split). */
#define N_RUN 16
/* Bytes of int8 x per chunk of rows kept in the cache while all weight rows pass (about half an L2). */
#define X_CHUNK_BYTES (512 * 1024)

AI float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

AI __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* acc + pairs (int16) times the int16 multipliers s, summed in pairs into int32 lanes. */
AI __m256i dot_pairs(__m256i acc, __m256i pairs, __m256i s) {
#if DOT_VNNI && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, pairs, s);
#elif DOT_VNNI
    return _mm256_dpwssd_avx_epi32(acc, pairs, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, s));
#endif
}

/* The sums of four products u (unsigned bytes) * v (signed bytes) in each int32 lane; |u| <= 128. */
AI __m256i dot_quads(__m256i u, __m256i v) {
#if DOT_VNNI && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#elif DOT_VNNI
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, v);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}

AI float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x's int8 form: xq [M][K], dx [M][K / QB], sums of xq per 16 [M][K / 16]; for QB = 32 also f [M][K / 32][2]:
 * dx and dx times the block's sum of xq, as floats (what a block's offset c multiplies). */
typedef struct {
    const int8_t *q;
    const float *d;
    const int16_t *s;
    const float *f;
    int64_t K, QB;
} xrows;

/* The floats f of one row of x (see xrows) out of its steps and sums per 16. */
static void block_sums_32(const float *xd, const int16_t *xs, int64_t K, float *xf) {
    for (int64_t b = 0; b < K / 32; b++) xf[2 * b] = xd[b], xf[2 * b + 1] = xd[b] * (float)(xs[2 * b] + xs[2 * b + 1]);
}

/* One row of x to int8 per block of QB (a multiple of 16), with the block steps and the sums per 16. */
static void quantize_row(const float *x, int64_t K, int64_t QB, int8_t *xq, float *xd, int16_t *xs) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b * QB < K; b++) {
        const float *xb = x + b * QB;
        __m256 mx = _mm256_setzero_ps();
        for (int64_t k = 0; k < QB; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + k), abs_mask));
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, mx);
        for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        for (int64_t k = 0; k < QB; k += 16) {
            /* cvtps rounds to nearest (even) in the default rounding mode; |x * inv| <= 127 up to rounding */
            const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + k), inv));
            const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + k + 8), inv));
            const __m256i s = _mm256_add_epi32(a, c);
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            t = _mm_hadd_epi32(t, t);
            t = _mm_hadd_epi32(t, t);
            xs[(b * QB + k) / 16] = (int16_t)_mm_cvtsi128_si32(t);
            const __m128i lo = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
            const __m128i hi = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
            _mm_storeu_si128((__m128i *)(xq + b * QB + k), _mm_packs_epi16(lo, hi));
        }
        xd[b] = amax / 127.0f;
    }
}

#if WIDE
/* The 512-bit Q4_K code multiplies the low nibbles of 64 bytes (sub-blocks 2j and 2j + 2) and then the high ones
 * (2j + 1, 2j + 3): x's 32-value runs 1 and 2 of each 128 swap places to match, its sums per 16 staying in order. */
static void swap_runs_for_q4_k(int8_t *xq, int64_t K) {
    for (int64_t k = 0; k < K; k += 128) {
        int8_t t[32];
        memcpy(t, xq + k + 32, 32);
        memcpy(xq + k + 32, xq + k + 64, 32);
        memcpy(xq + k + 64, t, 32);
    }
}
#endif

/* Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and minimums out of their 12 bytes, as 8 int16 each. Bytes 0-3 hold
 * scales 0-3 in their low 6 bits and the top 2 bits of scales 4-7, bytes 4-7 the same for the minimums, bytes 8-11
 * the low 4 bits of scales 4-7 (low nibbles) and of minimums 4-7 (high nibbles); four bytes at a time. */
AI void k_scales(const uint8_t *p, __m128i *sc, __m128i *mn) {
    uint32_t a, m, c;
    memcpy(&a, p, 4);
    memcpy(&m, p + 4, 4);
    memcpy(&c, p + 8, 4);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x30303030u; /* top2: bits 6-7 moved to 4-5 */
    const uint64_t s8 = ((uint64_t)((c & low4) | ((a >> 2) & top2)) << 32) | (a & low6);
    const uint64_t m8 = ((uint64_t)(((c >> 4) & low4) | ((m >> 2) & top2)) << 32) | (m & low6);
    *sc = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)s8));
    *mn = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m8));
}

/* 8 int16 -> 16: each twice, so that each pairs with the two sums per 16 of its sub-block of 32. */
AI __m256i twice(__m128i v) { return _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v)); }

/* Each tile function adds to y[r] (r < R) the products of one weight row's blocks with R rows of x. */

/* Q4_K / Q5_K run j (of 4) of the block at w: sub-blocks 2j (lo) and 2j + 1 (hi), 32 weights each, 0..31. */
AI void decode_k(const int type, const uint8_t *w, const int j, __m256i *lo, __m256i *hi) {
    const __m256i low = _mm256_set1_epi8(15);
    if (type == T_Q4_K) {
        const __m256i q = load32(w + 16 + 32 * j);
        *lo = _mm256_and_si256(q, low), *hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
    } else { /* Q5_K: bit 2j (2j + 1) of each of the 32 qh bytes is the fifth bit of sub-block 2j's (2j + 1's) weight */
        const __m256i q = load32(w + 48 + 32 * j), qh = load32(w + 16), one = _mm256_set1_epi8(1);
        const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4);
        const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4);
        *lo = _mm256_or_si256(_mm256_and_si256(q, low), h0);
        *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), low), h1);
    }
}

/* Q4_K and Q5_K (blocks of `bw` bytes): 6-bit scales as int16 multipliers of each sub-block's pairs, minimums
 * against x's sums per 16. */
AI void tile_k(const int type, const int bw, const uint8_t *w, int64_t nb, const xrows *x, int64_t m0, const int R,
               float *y) {
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bw) {
        __m128i sc16, mn16;
        k_scales(w + 4, &sc16, &mn16);
        int16_t sc[8];
        _mm_storeu_si128((__m128i *)sc, sc16);
        const __m256i mins = twice(mn16);
        const float d = f16(w), dmin = f16(w + 2);
        __m256i ia[MT];
        for (int r = 0; r < R; r++) ia[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i lo, hi;
            decode_k(type, w, j, &lo, &hi);
            const __m256i s0 = _mm256_set1_epi16(sc[2 * j]), s1 = _mm256_set1_epi16(sc[2 * j + 1]);
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x->q + (m0 + r) * x->K + b * 256 + 64 * j;
                ia[r] = dot_pairs(ia[r], _mm256_maddubs_epi16(lo, load32(xq)), s0);
                ia[r] = dot_pairs(ia[r], _mm256_maddubs_epi16(hi, load32(xq + 32)), s1);
            }
        }
        for (int r = 0; r < R; r++) {
            const float dx = x->d[(m0 + r) * (x->K / 256) + b];
            const int16_t *xs = x->s + (m0 + r) * (x->K / 16) + b * 16;
            const __m256i msum = _mm256_madd_epi16(mins, load32(xs)); /* m[j] * x's sum over sub-block j */
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r]), _mm256_set1_ps(d * dx), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(dmin * dx), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum(acc[r]);
}

AI void tile_q4_k(const uint8_t *w, int64_t nb, const xrows *x, int64_t m0, const int R, float *y) {
    tile_k(T_Q4_K, 144, w, nb, x, m0, R, y);
}
AI void tile_q5_k(const uint8_t *w, int64_t nb, const xrows *x, int64_t m0, const int R, float *y) {
    tile_k(T_Q5_K, 176, w, nb, x, m0, R, y);
}

AI void tile_q6_k(const uint8_t *w, int64_t nb, const xrows *x, int64_t m0, const int R, float *y) {
    const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(0x30);
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 210) {
        const int8_t *sc = (const int8_t *)(w + 192);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        const float d = f16(w + 208);
        __m256i ia[MT];
        for (int r = 0; r < R; r++) ia[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i a = load32(w + 64 * h), c = load32(w + 64 * h + 32), qh = load32(w + 128 + 32 * h);
            /* four runs of 32 weights: low nibbles of a, of c, high nibbles of a, of c; their 2 high bits are
             * bits 0-1, 2-3, 4-5, 6-7 of qh, moved to bits 4-5 */
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), two));
            q[1] = _mm256_or_si256(_mm256_and_si256(c, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), two));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(qh, two));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low),
                                   _mm256_and_si256(_mm256_srli_epi16(qh, 2), two));
            for (int i = 0; i < 4; i++) {
                const int g = 8 * h + 2 * i; /* the run's two groups of 16 */
                const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
                for (int r = 0; r < R; r++) {
                    const int8_t *xq = x->q + (m0 + r) * x->K + b * 256 + 128 * h + 32 * i;
                    ia[r] = dot_pairs(ia[r], _mm256_maddubs_epi16(q[i], load32(xq)), s);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const float dx = x->d[(m0 + r) * (x->K / 256) + b];
            const int16_t *xs = x->s + (m0 + r) * (x->K / 16) + b * 16;
            const __m256i ssum = _mm256_madd_epi16(sc16, load32(xs)); /* sc[g] * x's sum over group g */
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r]), _mm256_set1_ps(d * dx), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ssum), _mm256_set1_ps(32.0f * d * dx), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum(acc[r]);
}

/* The types whose weights come in sub-blocks of 32, each with its own float scale (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0;
 * IQ4_XS's 8 per block of 256): x is rounded per 32 for them, and sub-block j of a block decodes to 32 bytes q and
 * floats d, c with w[i] = d * q[i] + c. q is unsigned (at most 31: maddubs' pairs cannot saturate) or, for the
 * signed types, int8, whose sign then moves onto x (|q| <= 128 as unsigned). */
typedef struct {
    __m256i q;
    float d, c;
} sub32;

/* 16 bytes -> 32 weights: the low nibbles are weights 0-15, the high ones 16-31 (GGML's order in a block of 32). */
AI __m256i nibbles32(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

/* Q5_0 / Q5_1's 32 fifth bits (a little-endian uint32 at p, bit i for weight i) as bytes of 16 or 0. */
AI __m256i fifth_bits(const uint8_t *p) {
    uint32_t h;
    memcpy(&h, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_set1_epi8((__mmask32)h, 16);
#else /* byte i takes byte i / 8 of h, then its bit i % 8 */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h),
                                               _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                                 0x0101010101010101LL, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
#endif
}

/* IQ4_XS's 16 weight values (GGML's kvalues_iq4nl), indexed by a nibble. */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* IQ4_XS: sub-block j's 6-bit scale, a nibble of byte 4 + j / 2 below and 2 bits of the uint16 at byte 2 above. */
AI int iq4_scale(const uint8_t *w, int j) {
    return ((w[4 + j / 2] >> (4 * (j % 2))) & 15) | (((w[2 + j / 4] >> (2 * (j % 4))) & 3) << 4);
}

/* Sub-block j of the block of `type` at w (see each type's layout at the top). */
AI void decode32(const int type, const uint8_t *w, const int j, sub32 *s) {
    switch (type) {
        case T_Q4_0: s->q = nibbles32(w + 2), s->d = f16(w), s->c = -8.0f * s->d; break;
        case T_Q4_1: s->q = nibbles32(w + 4), s->d = f16(w), s->c = f16(w + 2); break;
        case T_Q5_0: s->q = _mm256_or_si256(nibbles32(w + 6), fifth_bits(w + 2)), s->d = f16(w), s->c = -16.0f * s->d;
            break;
        case T_Q5_1: s->q = _mm256_or_si256(nibbles32(w + 8), fifth_bits(w + 4)), s->d = f16(w), s->c = f16(w + 2);
            break;
        case T_Q8_0: s->q = load32(w + 2), s->d = f16(w), s->c = 0.0f; break;
        default: { /* T_IQ4_XS: a table lookup per nibble; 6-bit scale - 32 per sub-block */
            const __m128i values = _mm_loadu_si128((const __m128i *)IQ4_VALUES);
            s->q = _mm256_shuffle_epi8(_mm256_set_m128i(values, values), nibbles32(w + 8 + 16 * j));
            s->d = f16(w) * (float)(iq4_scale(w, j) - 32), s->c = 0.0f;
            break;
        }
    }
}

/* Blocks b0..nb of `bw` bytes holding `subs` sub-blocks of 32; `sgn`: q is signed; `offset`: the weights have a c. */
AI void tile32(const int type, const int bw, const int subs, const int sgn, const int offset, const uint8_t *w,
               int64_t b0, int64_t nb, const xrows *x, int64_t m0, const int R, float *y) {
    __m256 acc[MT];
    float off[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), off[r] = 0.0f;
    w += b0 * bw;
    for (int64_t b = b0; b < nb; b++, w += bw)
        for (int j = 0; j < subs; j++) {
            sub32 s;
            decode32(type, w, j, &s);
            const int64_t xb = b * subs + j; /* x's block of 32 */
            const __m256i u = sgn ? _mm256_sign_epi8(s.q, s.q) : s.q;
            for (int r = 0; r < R; r++) {
                const __m256i xq = load32(x->q + (m0 + r) * x->K + 32 * xb);
                const float *xf = x->f + (m0 + r) * (x->K / 16) + 2 * xb; /* dx, dx * sum */
                const __m256i dot = dot_quads(u, sgn ? _mm256_sign_epi8(xq, s.q) : xq);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s.d * xf[0]), acc[r]);
                if (offset) off[r] += s.c * xf[1]; /* c times x's sum over the sub-block */
            }
        }
    for (int r = 0; r < R; r++) y[r] = hsum(acc[r]) + off[r];
}

/* The family's types, one row each: name, GGML type, bytes and weights per block, signed q, offset c. */
#define FAMILY32(X)                           \
    X(q4_0, T_Q4_0, 18, 32, 0, 1)             \
    X(q4_1, T_Q4_1, 20, 32, 0, 1)             \
    X(q5_0, T_Q5_0, 22, 32, 0, 1)             \
    X(q5_1, T_Q5_1, 24, 32, 0, 1)             \
    X(q8_0, T_Q8_0, 34, 32, 1, 0)             \
    X(iq4_xs, T_IQ4_XS, 136, 256, 1, 0)


#if WIDE
AI __m512i load64(const void *p) { return _mm512_loadu_si512(p); }

AI float hsum512(__m512 v) {
    const __m256 top = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), top));
}

/* The 512-bit Q4_K: x in swapped runs (swap_runs_for_q4_k); each int16 pair of sub-block i takes scale sc[i]. */
AI void tile_q4_k_wide(const uint8_t *w, int64_t nb, const xrows *x, int64_t m0, const int R, float *y) {
    const __m512i low = _mm512_set1_epi8(15);
    /* int16 lanes 0-15 take scale 2j (low nibbles) or 2j + 1 (high), lanes 16-31 the one two sub-blocks on */
    const __m512i idx = _mm512_set_epi16(2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
                                         0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 144) {
        __m128i sc16, mn16;
        k_scales(w + 4, &sc16, &mn16);
        const __m256i mins = twice(mn16);
        const float d = f16(w), dmin = f16(w + 2);
        const __m512i scv = _mm512_castsi128_si512(sc16);
        __m512i ia[MT];
        for (int r = 0; r < R; r++) ia[r] = _mm512_setzero_si512();
        for (int c = 0; c < 2; c++) {
            const __m512i q = load64(w + 16 + 64 * c);
            const __m512i lo = _mm512_and_si512(q, low), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
            const __m512i s0 = _mm512_permutexvar_epi16(_mm512_add_epi16(idx, _mm512_set1_epi16(4 * c)), scv);
            const __m512i s1 = _mm512_permutexvar_epi16(_mm512_add_epi16(idx, _mm512_set1_epi16(4 * c + 1)), scv);
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x->q + (m0 + r) * x->K + b * 256 + 128 * c;
                ia[r] = _mm512_dpwssd_epi32(ia[r], _mm512_maddubs_epi16(lo, load64(xq)), s0);
                ia[r] = _mm512_dpwssd_epi32(ia[r], _mm512_maddubs_epi16(hi, load64(xq + 64)), s1);
            }
        }
        for (int r = 0; r < R; r++) {
            const float dx = x->d[(m0 + r) * (x->K / 256) + b];
            const int16_t *xs = x->s + (m0 + r) * (x->K / 16) + b * 16;
            const __m256i msum = _mm256_madd_epi16(mins, load32(xs)); /* m[j] * x's sum over sub-block j */
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), _mm512_set1_ps(d * dx), acc[r]);
            const __m512 mf = _mm512_cvtepi32_ps(_mm512_zextsi256_si512(msum));
            acc[r] = _mm512_fnmadd_ps(mf, _mm512_set1_ps(dmin * dx), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum512(acc[r]);
}

/* The 512-bit Q6_K: 64 bytes of low nibbles are 64 weights in order, and then the next 64; x in order. */
AI void tile_q6_k_wide(const uint8_t *w, int64_t nb, const xrows *x, int64_t m0, const int R, float *y) {
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(0x30);
    /* int16 lane i (bytes 2i, 2i + 1) of 64 weights from group 4t on: group 4t + i / 8 */
    const __m512i idx = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                         1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 210) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
        const float d = f16(w + 208);
        const __m512i scv = _mm512_castsi256_si512(sc16);
        __m512i ia[MT];
        for (int r = 0; r < R; r++) ia[r] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512i a = load64(w + 64 * h);
            const __m256i qh = load32(w + 128 + 32 * h);
            /* weights l and 32 + l take bits 0-1 and 2-3 of qh[l]; 64 + l and 96 + l bits 4-5 and 6-7 */
            const __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            const __m512i q0 = _mm512_or_si512(_mm512_and_si512(a, low),
                                               _mm512_and_si512(_mm512_slli_epi16(hb, 4), two));
            const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), low),
                                               _mm512_and_si512(hb, two));
            const __m512i s0 = _mm512_permutexvar_epi16(_mm512_add_epi16(idx, _mm512_set1_epi16(8 * h)), scv);
            const __m512i s1 = _mm512_permutexvar_epi16(_mm512_add_epi16(idx, _mm512_set1_epi16(8 * h + 4)), scv);
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x->q + (m0 + r) * x->K + b * 256 + 128 * h;
                ia[r] = _mm512_dpwssd_epi32(ia[r], _mm512_maddubs_epi16(q0, load64(xq)), s0);
                ia[r] = _mm512_dpwssd_epi32(ia[r], _mm512_maddubs_epi16(q1, load64(xq + 64)), s1);
            }
        }
        for (int r = 0; r < R; r++) {
            const float dx = x->d[(m0 + r) * (x->K / 256) + b];
            const int16_t *xs = x->s + (m0 + r) * (x->K / 16) + b * 16;
            const __m256i ssum = _mm256_madd_epi16(sc16, load32(xs)); /* sc[g] * x's sum over group g */
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), _mm512_set1_ps(d * dx), acc[r]);
            const __m512 sf = _mm512_cvtepi32_ps(_mm512_zextsi256_si512(ssum));
            acc[r] = _mm512_fnmadd_ps(sf, _mm512_set1_ps(32.0f * d * dx), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum512(acc[r]);
}

/* The 512-bit family: two sub-blocks A, B at a time, as 64 bytes in x's pair order (A's weights 0-15, B's 0-15, A's
 * 16-31, B's 16-31: two runs of 16 nibbles side by side, then their high nibbles) and floats [dA, cA, dB, cB]. Every
 * q is unsigned here (vpdpbusd cannot saturate): signed types take q + 128, and c = -128 d with it. */
AI __m512i pair_nibbles(const uint8_t *a, const uint8_t *b) {
    const __m256i y = _mm256_loadu2_m128i((const __m128i *)b, (const __m128i *)a);
    return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1),
                            _mm512_set1_epi8(15));
}

/* Q5_0 / Q5_1: A's and B's fifth bits (uint32 at a and b) as bytes of 16 in pair order. */
AI __m512i pair_fifth_bits(const uint8_t *a, const uint8_t *b) {
    uint32_t ha, hb;
    memcpy(&ha, a, 4);
    memcpy(&hb, b, 4);
    const uint64_t mask = (uint64_t)(ha & 0xffff) | (uint64_t)(hb & 0xffff) << 16 | (uint64_t)(ha >> 16) << 32 |
                          (uint64_t)(hb >> 16) << 48;
    return _mm512_maskz_set1_epi8((__mmask64)mask, 16);
}

/* [d, d, d', d'] for the float16 d at a and d' at b, times [1, k, 1, k]: each block's d and c = k d. */
AI __m128 pair_scales(const uint8_t *a, const uint8_t *b, float k) {
    uint16_t da, db;
    memcpy(&da, a, 2);
    memcpy(&db, b, 2);
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(da | (uint32_t)db << 16)));
    return _mm_mul_ps(_mm_unpacklo_ps(d, d), _mm_setr_ps(1.0f, k, 1.0f, k));
}

/* Sub-blocks A = (a, ja) and B = (b, jb) of `type` (a and b: their blocks), as above. */
AI void decode_pair(const int type, const uint8_t *a, const int ja, const uint8_t *b, __m512i *q, __m128 *dc) {
    switch (type) {
        case T_Q4_0: *q = pair_nibbles(a + 2, b + 2), *dc = pair_scales(a, b, -8.0f); break;
        case T_Q4_1: { /* d and m side by side at each block's start */
            uint32_t fa, fb;
            memcpy(&fa, a, 4);
            memcpy(&fb, b, 4);
            *q = pair_nibbles(a + 4, b + 4), *dc = _mm_cvtph_ps(_mm_set_epi32(0, 0, (int)fb, (int)fa));
            break;
        }
        case T_Q5_0:
            *q = _mm512_or_si512(pair_nibbles(a + 6, b + 6), pair_fifth_bits(a + 2, b + 2));
            *dc = pair_scales(a, b, -16.0f);
            break;
        case T_Q5_1: {
            uint32_t fa, fb;
            memcpy(&fa, a, 4);
            memcpy(&fb, b, 4);
            *q = _mm512_or_si512(pair_nibbles(a + 8, b + 8), pair_fifth_bits(a + 4, b + 4));
            *dc = _mm_cvtph_ps(_mm_set_epi32(0, 0, (int)fb, (int)fa));
            break;
        }
        case T_Q8_0: { /* [A | B] with their middle 16-byte runs swapped, + 128 */
            const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(load32(a + 2)), load32(b + 2), 1);
            *q = _mm512_xor_si512(_mm512_shuffle_i64x2(ab, ab, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_set1_epi8(-128));
            *dc = pair_scales(a, b, -128.0f);
            break;
        }
        default: { /* T_IQ4_XS: sub-blocks ja and ja + 1 of one block, their nibbles 32 bytes in a row */
            const __m256i y = load32(a + 8 + 16 * ja);
            const __m512i nib = _mm512_and_si512(
                _mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1), _mm512_set1_epi8(15));
            const __m128i values = _mm_xor_si128(_mm_loadu_si128((const __m128i *)IQ4_VALUES), _mm_set1_epi8(-128));
            *q = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(values), nib);
            const float d = f16(a), da = d * (float)(iq4_scale(a, ja) - 32);
            const float db = d * (float)(iq4_scale(a, ja + 1) - 32);
            *dc = _mm_setr_ps(da, -128.0f * da, db, -128.0f * db);
            break;
        }
    }
}

/* x's int8 runs in pair order for the 512-bit family: in each 64 bytes (two blocks of 32) the middle runs of 16
 * swap places; a last, unpaired block stays as it is. */
static void pair_order_for_32(int8_t *xq, int64_t K) {
    for (int64_t k = 0; k + 64 <= K; k += 64) {
        int8_t t[16];
        memcpy(t, xq + k + 16, 16);
        memcpy(xq + k + 16, xq + k + 32, 16);
        memcpy(xq + k + 32, t, 16);
    }
}

AI void tile32_wide(const int type, const int bw, const int subs, const int sgn, const int offset, const uint8_t *w,
                    int64_t nb, const xrows *x, int64_t m0, const int R, float *y) {
    /* the int32 lanes of a pair's dot products: 0-3 and 8-11 A's, 4-7 and 12-15 B's; their scales' places in
     * [dA dx, .., dB dx, ..] */
    const __m512i lanes = _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0);
    __m512 acc[MT];
    __m128 off[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), off[r] = _mm_setzero_ps();
    /* pairs of blocks (one block of 32 each), or pairs of sub-blocks within a block (a constant j each) */
    const int64_t steps = subs == 1 ? nb / 2 : nb, per_step = subs == 1 ? 1 : subs / 2;
    for (int64_t p = 0, i = 0; i < steps; i++)
        for (int jp = 0; jp < per_step; jp++, p++) {
            __m512i q;
            __m128 dc;
            if (subs == 1)
                decode_pair(type, w + 2 * i * bw, 0, w + (2 * i + 1) * bw, &q, &dc);
            else
                decode_pair(type, w + i * bw, 2 * jp, w + i * bw, &q, &dc);
            for (int r = 0; r < R; r++) {
                const __m512i xq = load64(x->q + (m0 + r) * x->K + 64 * p);
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xq);
                /* [dA dxA, cA dxA sumA, dB dxB, cB dxB sumB] */
                const __m128 t = _mm_mul_ps(dc, _mm_loadu_ps(x->f + (m0 + r) * (x->K / 16) + 4 * p));
                off[r] = _mm_mask_add_ps(off[r], 0xa, off[r], t);
                const __m512 scale = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(t));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
            }
        }
    for (int r = 0; r < R; r++) y[r] = hsum512(_mm512_add_ps(acc[r], _mm512_zextps128_ps512(off[r])));
    if (nb * subs % 2) { /* an odd number of blocks of 32: the last one as the 256-bit code takes it */
        float t[MT];
        tile32(type, bw, subs, sgn, offset, w, nb - 1, nb, x, m0, R, t);
        for (int r = 0; r < R; r++) y[r] += t[r];
    }
}
#endif

#if WIDE
#define TILE32_OF(name, type, bw, bk, sgn, offset)                                                        \
    AI void tile_##name(const uint8_t *w, int64_t nb, const xrows *x, int64_t m0, const int R, float *y) { \
        tile32_wide(type, bw, bk / 32, sgn, offset, w, nb, x, m0, R, y);                                  \
    }
#define PREP_32 pair_order_for_32
#else
#define TILE32_OF(name, type, bw, bk, sgn, offset)                                                        \
    AI void tile_##name(const uint8_t *w, int64_t nb, const xrows *x, int64_t m0, const int R, float *y) { \
        tile32(type, bw, bk / 32, sgn, offset, w, 0, nb, x, m0, R, y);                                    \
    }
#define PREP_32 NULL
#endif
FAMILY32(TILE32_OF)
#undef TILE32_OF

/* y[m0 .. m0 + rows, n] for weight rows n0 .. n1 (row n at w + n * ldw; out: y's row m0), in tiles of MT rows of
 * x (constant R in each call, specialised). */
#define ROWS_OF(fn)                                                                                           \
    static void rows_##fn(const uint8_t *w, int64_t ldw, int64_t n0, int64_t n1, int64_t nb, const xrows *x,   \
                          int64_t m0, int64_t rows, float *out, int64_t ldy) {                                \
        for (int64_t n = n0; n < n1; n++) {                                                                   \
            const uint8_t *wn = w + n * ldw;                                                                  \
            float t[MT];                                                                                      \
            int64_t m = 0;                                                                                    \
            for (; m + MT <= rows; m += MT) {                                                                 \
                fn(wn, nb, x, m0 + m, MT, t);                                                                 \
                for (int r = 0; r < MT; r++) out[(m + r) * ldy + n] = t[r];                                   \
            }                                                                                                 \
            const int rest = (int)(rows - m);                                                                 \
            switch (rest) { /* the last rows as one tile of their exact count (constant R in each) */         \
                case 1: fn(wn, nb, x, m0 + m, 1, t); break;                                                   \
                case 2: fn(wn, nb, x, m0 + m, 2, t); break;                                                   \
                case 3: fn(wn, nb, x, m0 + m, 3, t); break;                                                   \
                case 4: if (MT > 4) fn(wn, nb, x, m0 + m, 4, t); break;                                       \
                case 5: if (MT > 5) fn(wn, nb, x, m0 + m, 5, t); break;                                       \
                case 6: if (MT > 6) fn(wn, nb, x, m0 + m, 6, t); break;                                       \
                case 7: if (MT > 7) fn(wn, nb, x, m0 + m, 7, t); break;                                       \
                default: break;                                                                               \
            }                                                                                                 \
            for (int r = 0; r < rest; r++) out[(m + r) * ldy + n] = t[r];                                     \
        }                                                                                                     \
    }
#define ROWS32_OF(name, type, bw, bk, sgn, offset) ROWS_OF(tile_##name)
FAMILY32(ROWS32_OF)
#undef ROWS32_OF
ROWS_OF(tile_q5_k)
#if WIDE
ROWS_OF(tile_q4_k_wide)
ROWS_OF(tile_q6_k_wide)
#define ROWS_Q4_K rows_tile_q4_k_wide
#define ROWS_Q6_K rows_tile_q6_k_wide
#define PREP_Q4_K swap_runs_for_q4_k
#else
ROWS_OF(tile_q4_k)
ROWS_OF(tile_q6_k)
#define ROWS_Q4_K rows_tile_q4_k
#define ROWS_Q6_K rows_tile_q6_k
#define PREP_Q4_K NULL
#endif
#undef ROWS_OF

/* A type served: its block of `bw` bytes and `bk` weights, the activations' block (QB) it takes, the rows function,
 * and what its tiles need done to each row of int8 x first (or NULL). */
typedef struct {
    int type;
    int64_t bw, bk, qb;
    void (*rows)(const uint8_t *w, int64_t ldw, int64_t n0, int64_t n1, int64_t nb, const xrows *x, int64_t m0,
                 int64_t rows, float *out, int64_t ldy);
    void (*prep_x)(int8_t *xq, int64_t K);
} gguf_type;

#define ROW32(name, type, bw, bk, sgn, offset) {type, bw, bk, 32, rows_tile_##name, PREP_32},
static const gguf_type TYPES[] = {
    FAMILY32(ROW32)
    {T_Q4_K, 144, 256, 256, ROWS_Q4_K, PREP_Q4_K},
    {T_Q5_K, 176, 256, 256, rows_tile_q5_k, NULL},
    {T_Q6_K, 210, 256, 256, ROWS_Q6_K, NULL},
};
#undef ROW32

static const gguf_type *type_of(int type) {
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i].type == type) return &TYPES[i];
    return NULL;
}

/* The bytes a row of K weights of `type` takes, or -1 for a type this kernel does not serve or K not whole blocks. */
int64_t vx_gguf_row_bytes(int type, int64_t K) {
    const gguf_type *t = type_of(type);
    if (!t || K <= 0 || K % t->bk) return -1;
    return K / t->bk * t->bw;
}

int vx_gguf_types(void) {
    int mask = 0;
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++) mask |= 1 << TYPES[i].type;
    return mask;
}
int vx_gguf_vnni(void) { return DOT_VNNI; }

/* y[M, N] (row stride ldy) = x[M, K] @ W^T for W's N rows of GGML `type` blocks, row r at w + r * ldw bytes.
 * Returns 0, -1 for an unserved type or bad sizes, -2 when the activations' scratch cannot be allocated. */
int vx_gguf_matmul_f32(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t ldw, int type, int64_t N,
                       float *y, int64_t ldy, int nthreads) {
    const gguf_type *t = type_of(type);
    if (!t || M < 0 || N < 0 || K <= 0 || K % t->bk || ldw < K / t->bk * t->bw || ldy < N) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t qb = t->qb;
    const int64_t nf = qb == 32 ? K / 16 : 0; /* floats of x->f a row */
    char *scratch = malloc(M * K + M * (K / qb + nf) * sizeof(float) + M * (K / 16) * sizeof(int16_t));
    if (!scratch) return -2;
    float *xd = (float *)scratch, *xf = xd + M * (K / qb);
    int16_t *xs = (int16_t *)(xf + M * nf);
    int8_t *xq = (int8_t *)(xs + M * (K / 16));
    const xrows xr = {xq, xd, xs, xf, K, qb};
    const int64_t nb = K / t->bk;
    int64_t chunk = X_CHUNK_BYTES / K;
    chunk = chunk < MT ? MT : chunk - chunk % MT;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            quantize_row(x + m * K, K, qb, xq + m * K, xd + m * (K / qb), xs + m * (K / 16));
            if (nf) block_sums_32(xd + m * (K / qb), xs + m * (K / 16), K, xf + m * nf);
            if (t->prep_x) t->prep_x(xq + m * K, K);
        }
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n += N_RUN) /* runs of weight rows: one call each */
                t->rows(w, ldw, n, n + N_RUN < N ? n + N_RUN : N, nb, &xr, m0, rows, y + m0 * ldy, ldy);
        }
    }
    free(scratch);
    return 0;
}

#else /* no AVX2: this build serves no type, and every GGUF weight keeps the repacked path */
int64_t vx_gguf_row_bytes(int type, int64_t K) { return -1; }
int vx_gguf_types(void) { return 0; }
int vx_gguf_vnni(void) { return 0; }
int vx_gguf_matmul_f32(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t ldw, int type, int64_t N,
                       float *y, int64_t ldy, int nthreads) {
    return -1;
}
#endif
