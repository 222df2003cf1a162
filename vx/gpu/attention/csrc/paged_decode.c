/* Paged decode attention on the CPU: one query token per sequence, reading K/V in place from the paged cache.
 *
 * The torch backend otherwise gathers every context into a padded batch before SDPA, which triples the memory
 * traffic of a step that is memory-bound. Here each (sequence, kv head) task streams its blocks once, with an
 * online softmax over the block's tokens for the group of query heads that share the kv head (GQA).
 *
 * Layouts (all contiguous):
 *   q, out:       rows of [H * D] (head-major, row strides q_stride / out_stride, in elements) of float32, or of
 *                 bfloat16 (io_kind KV_BF16: a bf16 model's own rows, read into float32 and rounded back to
 *                 nearest-even once); sequence i's query is row q_rows[i], its output row out_rows[i] (row i where
 *                 q_rows / out_rows is NULL)
 *   k_new, v_new: optional (num_new > 0): the step's own key/value rows, [Hk * row] bytes each at strides of
 *                 k_new_stride / v_new_stride bytes, in the cache's kind; row r is stored at slot new_slots[r] (block slot /
 *                 block_size, token slot % block_size; a negative slot is skipped) before anything is read, so
 *                 that a sequence attends to its newest token
 *   k/v cache:    [num_blocks, block_size, Hk, row] where a row is one token's key (value) for one kv head, per
 *                 kv_kind (vx/gpu/attention/kv_format.py): KV_F32 D floats; KV_FP8 D float8 e4m3 codes; KV_INT8 D
 *                 int8 codes then the row's float32 scale; KV_BF16 / KV_F16 D bfloat16 / float16 values (a bf16
 *                 or fp16 model's own cache). tensor_scale_k/v multiply every key/value (fp8's per-tensor scale; 1
 *                 otherwise).
 *   block_table:  int32 [num_seqs, bt_stride]; seq_lens: int32 [num_seqs]
 * The (sequence, kv head) tasks run on num_threads OpenMP threads, or on the calling thread alone when the tokens
 * read times the kv heads fall below min_parallel_work (waking a sleeping team costs more than such calls).
 * window > 0 limits attention to the last `window` positions (the query's own included), as in HF.
 * The 8- and 16-bit kinds are decoded 16 rows at a time into a small float buffer (in L1) that serves every query
 * head of the group (the arithmetic stays in float32 whatever the cache holds). For the 8-bit kinds: a quarter of the float32 cache's bytes cross memory, each code is decoded once, and int8's row scales
 * are folded into the score (K) and the softmax weight (V) rather than into each element. (Decoding each row inside
 * every head's loop instead, once per head, measured ~2x slower for fp8 at 3 heads per kv head.)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

enum { KV_F32 = 0, KV_FP8 = 1, KV_INT8 = 2, KV_BF16 = 3, KV_F16 = 4 };

#define MAX_GROUP 32   /* query heads per kv head */
#define MAX_DIM 256    /* head_dim */
#define MAX_BLOCK 128  /* block_size */
#define NEG_BIG -1e30f /* the running max before any score: finite, since the file builds with -ffast-math */

/* float8 e4m3fn -> float, portably: sign, 4 exponent bits (bias 7), 3 mantissa bits, exponent 0 subnormal. Built
 * from a normal power of two, so it never makes a float subnormal (which a flush-to-zero process would zero). */
static inline float fp8_e4m3_to_float(uint8_t code) {
    const int32_t e = (code >> 3) & 15, m = code & 7;
    const uint32_t pow2_bits = (uint32_t)((e > 1 ? e : 1) + 117) << 23; /* 2^(max(e, 1) - 10) */
    float pow2;
    memcpy(&pow2, &pow2_bits, sizeof pow2);
    const float x = (float)(e ? m + 8 : m) * pow2;
    return code & 0x80 ? -x : x;
}

/* n float8 e4m3fn codes -> floats. With AVX2 + F16C (x86 since 2013), 8 at a time: the code's 7 low bits shifted into
 * a half's exponent and mantissa make the same number times 2^-8 (half's exponent bias is 15, e4m3's 7), subnormals
 * included, and F16C converts halves to floats exactly (measured: a decode step's attention ~1.2x faster than
 * with the integer decode below, which serves other CPUs and the row's last n % 8 codes). */
static inline __attribute__((always_inline)) void fp8_row_to_float(const uint8_t *restrict row, int64_t n,
                                                                   float *restrict out) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    const __m128i low7 = _mm_set1_epi16(0x7F), sign = _mm_set1_epi16(0x80);
    const __m256 two8 = _mm256_set1_ps(256.f);
    for (; i + 8 <= n; i += 8) {
        const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(row + i)));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, sign), 8),
                                       _mm_slli_epi16(_mm_and_si128(c, low7), 7));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(h), two8));
    }
#endif
    for (; i < n; i++) out[i] = fp8_e4m3_to_float(row[i]);
}

/* IEEE half -> float, portably (subnormal halves become normal floats; inf and NaN stay so). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
    uint32_t bits;
    float f;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in float */
        f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    bits = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* n 16-bit values -> floats: bfloat16 is a float's upper half; float16 through F16C 8 at a time where the CPU has it. */
static inline __attribute__((always_inline)) void half_row_to_float(const uint16_t *restrict row, int64_t n,
                                                                    const int kind, float *restrict out) {
    int64_t i = 0;
    if (kind == KV_BF16) {
#pragma omp simd
        for (int64_t j = 0; j < n; j++) {
            const uint32_t bits = (uint32_t)row[j] << 16;
            float f;
            memcpy(&f, &bits, sizeof f);
            out[j] = f;
        }
        return;
    }
#if defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + i))));
#endif
    for (; i < n; i++) out[i] = half_to_float(row[i]);
}

/* The row's own scale: KV_INT8 keeps a float32 after its head_dim codes; the others have none. */
static inline __attribute__((always_inline)) float row_scale(const uint8_t *row, int64_t head_dim, const int kind) {
    if (kind != KV_INT8) return 1.f;
    float s;
    memcpy(&s, row + head_dim, sizeof s);
    return s;
}

/* n 8- or 16-bit cache rows (byte stride `stride`) decoded into floats (row stride head_dim) and their scales. */
static inline __attribute__((always_inline)) void decode_rows(const uint8_t *rows, int64_t stride, int64_t n,
                                                              int64_t head_dim, const int kind, float *restrict out,
                                                              float *restrict scales) {
    for (int64_t t = 0; t < n; t++) {
        const uint8_t *row = rows + t * stride;
        float *o = out + t * head_dim;
        if (kind == KV_FP8) {
            fp8_row_to_float(row, head_dim, o);
        } else if (kind == KV_BF16 || kind == KV_F16) {
            half_row_to_float((const uint16_t *)row, head_dim, kind, o);
        } else {
            const int8_t *codes = (const int8_t *)row;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; i++) o[i] = (float)codes[i];
        }
        scales[t] = row_scale(row, head_dim, kind);
    }
}

/* float -> bfloat16, rounded to nearest-even (as torch rounds); NaN stays a quiet NaN. Integer tests only: the
 * file builds with -ffast-math, under which isnan() may fold to false. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Ask for a block's keys and values (every kv head's rows: 2 x blk_stride bytes) ahead of their use. Without it a
 * task stalls on each block: a sequence's blocks lie apart in the pool, each a few KB, too short for the hardware's
 * stream prefetcher to get going. Measured (30 layers' bf16 caches cold, 128 sequences x 96 tokens, 9/3 heads of 64,
 * 2 threads, AMX Xeon): 31 -> 21 ms for the 30 calls, 9 -> 14 GB/s; 32 x 512: 42 -> 28 ms; float32 1.3x. */
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *k_cache, const uint8_t *v_cache,
                                                                 int32_t block, int64_t blk_stride) {
    const uint8_t *k = k_cache + block * blk_stride, *v = v_cache + block * blk_stride;
    for (int64_t off = 0; off < blk_stride; off += 64) {
        __builtin_prefetch(k + off, 0, 3);
        __builtin_prefetch(v + off, 0, 3);
    }
}

/* One (sequence, kv head) task. Always inlined, so that the dispatch below can give it a constant head_dim and
 * kind: the compiler then unrolls the per-token dot products and vector updates completely.
 * The context goes by chunks of up to CHUNK tokens (one block, or a part of a larger one). A float32 chunk is read
 * in place; any other is first decoded into a small float buffer, once for all the query heads of the group.
 * Then each head runs through the chunk with its query and its accumulator held in registers: scores, the online
 * softmax update, the weighted values. */
#define CHUNK 16
static inline __attribute__((always_inline)) void attend(
        const float *restrict qs, float *restrict os, const uint8_t *k_cache, const uint8_t *v_cache,
        const int32_t *blocks, int64_t len, int64_t first, int64_t group, const int64_t head_dim, const int kind,
        int64_t block_size, int64_t row_bytes, int64_t tok_stride, int64_t blk_stride, int64_t kh, float scale) {
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP * MAX_DIM], p[CHUNK];
    float kbuf[CHUNK * MAX_DIM], vbuf[CHUNK * MAX_DIM], kscale[CHUNK], vscale[CHUNK]; /* kinds other than float32 */
    for (int64_t g = 0; g < group; g++) {
        m[g] = NEG_BIG;
        l[g] = 0.f;
        for (int64_t d = 0; d < head_dim; d++) acc[g * head_dim + d] = 0.f;
    }
    for (int64_t b = first / block_size; b * block_size < len; b++) {
        const int64_t t0 = b * block_size > first ? 0 : first - b * block_size;
        const int64_t t1 = (b + 1) * block_size <= len ? block_size : len - b * block_size;
        const uint8_t *kb = k_cache + blocks[b] * blk_stride + kh * row_bytes;
        const uint8_t *vb = v_cache + blocks[b] * blk_stride + kh * row_bytes;
        /* The next block, by the first kv head's task: those of the other heads then find it in cache. */
        if (kh == 0 && (b + 1) * block_size < len) prefetch_block(k_cache, v_cache, blocks[b + 1], blk_stride);
        for (int64_t c0 = t0; c0 < t1; c0 += CHUNK) {
            const int64_t n = t1 - c0 < CHUNK ? t1 - c0 : CHUNK;
            const float *kf, *vf;
            int64_t fstride; /* floats from one row to the next */
            if (kind == KV_F32) {
                kf = (const float *)(kb + c0 * tok_stride);
                vf = (const float *)(vb + c0 * tok_stride);
                fstride = tok_stride / (int64_t)sizeof(float);
            } else {
                decode_rows(kb + c0 * tok_stride, tok_stride, n, head_dim, kind, kbuf, kscale);
                decode_rows(vb + c0 * tok_stride, tok_stride, n, head_dim, kind, vbuf, vscale);
                kf = kbuf;
                vf = vbuf;
                fstride = head_dim;
            }
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qs + g * head_dim;
                float bmax = NEG_BIG;
                for (int64_t t = 0; t < n; t++) {
                    const float sc = dot(qg, kf + t * fstride, head_dim) * scale * (kind == KV_INT8 ? kscale[t] : 1.f);
                    p[t] = sc;
                    bmax = sc > bmax ? sc : bmax;
                }
                const float new_m = bmax > m[g] ? bmax : m[g];
                const float correction = expf(m[g] - new_m); /* 0 on the first chunk */
                float bsum = 0.f;
                /* A separate loop, so that the compiler calls the vector expf (libmvec). */
#pragma omp simd reduction(+ : bsum)
                for (int64_t t = 0; t < n; t++) {
                    p[t] = expf(p[t] - new_m);
                    bsum += p[t];
                }
                float *ag = acc + g * head_dim;
                l[g] = l[g] * correction + bsum;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) ag[d] *= correction;
                for (int64_t t = 0; t < n; t++) {
                    const float w = p[t] * (kind == KV_INT8 ? vscale[t] : 1.f);
                    const float *vt = vf + t * fstride;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) ag[d] += w * vt[d];
                }
                m[g] = new_m;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < head_dim; d++) os[g * head_dim + d] = acc[g * head_dim + d] * inv;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif
#if HAVE_BF16_DOT
/* Lane t of the result: the sum of v[t]'s 16 lanes (a transposing tree: 45 shuffles and adds for 16 sums where
 * one horizontal sum each would take ~128). */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 *v) {
    __m512 x[8], y[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: the four vectors' partial sums, in order */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

/* 16 bf16 -> 16 floats (a bf16 is a float's upper half). */
static inline __attribute__((always_inline)) __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* `attend` for a bf16 model over its bf16 cache, head_dim a multiple of 32 (io and cache both bf16): the scores
 * come from AVX512-BF16 dot products (bf16 pairs multiplied exactly and summed in float32) of the bf16 query with
 * each key as stored, 16 tokens at a time summed by one tree; values are widened to float32 as they are read.
 * Measured 720 -> 648 us a call against `attend` (128 sequences x 100 tokens, 9/3 heads of 64, 2 threads, AMX
 * Xeon): the call is then near what the cores stream from memory (~9 GB/s on one thread against 14 for a plain
 * sum), so more arithmetic saved buys little. */
static inline __attribute__((always_inline)) void attend_bf16(
        const uint16_t *restrict q16, float *restrict os, const uint8_t *k_cache, const uint8_t *v_cache,
        const int32_t *blocks, int64_t len, int64_t first, int64_t group, const int64_t head_dim,
        int64_t block_size, int64_t row_bytes, int64_t tok_stride, int64_t blk_stride, int64_t kh, float scale) {
    enum { VD = MAX_DIM / 16 };
    const int64_t nv = head_dim / 16, nq = head_dim / 32;
    float m[MAX_GROUP], l[MAX_GROUP], p[MAX_GROUP][CHUNK];
    __m512 acc[MAX_GROUP][VD];
    for (int64_t g = 0; g < group; g++) {
        m[g] = NEG_BIG;
        l[g] = 0.f;
        for (int64_t j = 0; j < nv; j++) acc[g][j] = _mm512_setzero_ps();
    }
    for (int64_t b = first / block_size; b * block_size < len; b++) {
        const int64_t t0 = b * block_size > first ? 0 : first - b * block_size;
        const int64_t t1 = (b + 1) * block_size <= len ? block_size : len - b * block_size;
        const uint8_t *kb = k_cache + blocks[b] * blk_stride + kh * row_bytes;
        const uint8_t *vb = v_cache + blocks[b] * blk_stride + kh * row_bytes;
        /* The next block, by the first kv head's task: those of the other heads then find it in cache. */
        if (kh == 0 && (b + 1) * block_size < len) prefetch_block(k_cache, v_cache, blocks[b + 1], blk_stride);
        for (int64_t c0 = t0; c0 < t1; c0 += CHUNK) {
            const int64_t n = t1 - c0 < CHUNK ? t1 - c0 : CHUNK;
            for (int64_t g = 0; g < group; g++) {
                const uint16_t *qg = q16 + g * head_dim;
                __m512 dots[CHUNK];
                for (int64_t t = 0; t < CHUNK; t++) {
                    __m512 d = _mm512_setzero_ps();
                    if (t < n) {
                        const uint16_t *kt = (const uint16_t *)(kb + (c0 + t) * tok_stride);
                        for (int64_t j = 0; j < nq; j++)
                            d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_loadu_si512(qg + 32 * j),
                                                 (__m512bh)_mm512_loadu_si512(kt + 32 * j));
                    }
                    dots[t] = d;
                }
                const __m512 scores = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale));
                const __mmask16 live = (__mmask16)((1u << n) - 1u);
                const float bmax = _mm512_mask_reduce_max_ps(live, scores);
                const float new_m = bmax > m[g] ? bmax : m[g];
                const float correction = expf(m[g] - new_m); /* 0 on the first chunk */
                _mm512_storeu_ps(p[g], scores);
                float bsum = 0.f;
#pragma omp simd reduction(+ : bsum)
                for (int64_t t = 0; t < CHUNK; t++) {
                    p[g][t] = t < n ? expf(p[g][t] - new_m) : 0.f;
                    bsum += p[g][t];
                }
                l[g] = l[g] * correction + bsum;
                m[g] = new_m;
                const __m512 c = _mm512_set1_ps(correction);
                for (int64_t j = 0; j < nv; j++) acc[g][j] = _mm512_mul_ps(acc[g][j], c);
            }
            for (int64_t t = 0; t < n; t++) {
                const uint16_t *vt = (const uint16_t *)(vb + (c0 + t) * tok_stride);
                __m512 vrow[VD];
                for (int64_t j = 0; j < nv; j++) vrow[j] = bf16x16(vt + 16 * j);
                for (int64_t g = 0; g < group; g++) {
                    const __m512 w = _mm512_set1_ps(p[g][t]);
                    for (int64_t j = 0; j < nv; j++) acc[g][j] = _mm512_fmadd_ps(w, vrow[j], acc[g][j]);
                }
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const __m512 inv = _mm512_set1_ps(l[g] > 0.f ? 1.f / l[g] : 0.f);
        for (int64_t j = 0; j < nv; j++) _mm512_storeu_ps(os + g * head_dim + 16 * j, _mm512_mul_ps(acc[g][j], inv));
    }
}
#endif

int vx_paged_decode(const void *q, int64_t q_stride, const int64_t *q_rows, uint8_t *k_cache, uint8_t *v_cache,
                    int64_t kv_kind, int64_t row_bytes, float tensor_scale_k, float tensor_scale_v,
                    const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, int64_t num_seqs,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                    int64_t window, void *out, int64_t out_stride, const int64_t *out_rows, int num_threads,
                    int64_t min_parallel_work, int64_t io_kind, const uint8_t *k_new, const uint8_t *v_new,
                    int64_t k_new_stride, int64_t v_new_stride, const int64_t *new_slots, int64_t num_new) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_DIM || block_size > MAX_BLOCK || num_heads % num_kv_heads) return -1;
    if (kv_kind < KV_F32 || kv_kind > KV_F16 || (io_kind != KV_F32 && io_kind != KV_BF16)) return -1;
    const int64_t tok_stride = num_kv_heads * row_bytes;
    const int64_t blk_stride = block_size * tok_stride;
    const float score_scale = scale * tensor_scale_k;

    /* The step's own rows first: a few KB, on this thread. */
    for (int64_t r = 0; r < num_new; r++) {
        const int64_t slot = new_slots[r];
        if (slot < 0) continue;
        const int64_t at = (slot / block_size) * blk_stride + (slot % block_size) * tok_stride;
        memcpy(k_cache + at, k_new + r * k_new_stride, (size_t)tok_stride);
        memcpy(v_cache + at, v_new + r * v_new_stride, (size_t)tok_stride);
    }

    /* Few tokens to read: the calling thread alone is done before a sleeping team would wake. */
    int64_t work = 0;
    for (int64_t s = 0; s < num_seqs; s++) work += seq_lens[s] * num_kv_heads;
    /* Enough sequences to share out: a thread takes all kv heads of a sequence at once, so that it reads each
     * token's rows of every head (one stretch of memory) rather than one head's rows at the cache's stride, the
     * other heads' lines then crossing to another core. Measured: 128 sequences x 100 tokens, 9/3 heads of 64,
     * bf16, 2 threads: 648 -> 618 us a call. */
    const int per_task = num_seqs >= 2 * (int64_t)num_threads ? (int)num_kv_heads : 1;
#pragma omp parallel for schedule(dynamic, per_task) num_threads(num_threads) if (work >= min_parallel_work)
    for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
        const int64_t s = task / num_kv_heads, kh = task % num_kv_heads;
        const int64_t len = seq_lens[s];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const int64_t q_at = (q_rows ? q_rows[s] : s) * q_stride + kh * group * head_dim;
        const int64_t out_at = (out_rows ? out_rows[s] : s) * out_stride + kh * group * head_dim;
        const int64_t width = group * head_dim;
        float qbuf[MAX_GROUP * MAX_DIM], obuf[MAX_GROUP * MAX_DIM]; /* a bf16 model's rows, in float32 */
        /* A bf16 model over its own cache: attend_bf16 reads the bf16 query as it is. */
        const int bf16_dot = HAVE_BF16_DOT && kv_kind == KV_BF16 && io_kind == KV_BF16 && head_dim % 32 == 0;
        const float *qs;
        float *os;
        if (io_kind == KV_F32) {
            qs = (const float *)q + q_at;
            os = (float *)out + out_at;
        } else {
            if (!bf16_dot) half_row_to_float((const uint16_t *)q + q_at, width, KV_BF16, qbuf);
            qs = qbuf;
            os = obuf;
        }
        const int32_t *blocks = block_table + s * bt_stride;
        /* The first block of the sequence this thread likely takes next (the other thread takes s + 1). */
        if (kh == 0 && s + 2 < num_seqs && seq_lens[s + 2] > 0)
            prefetch_block(k_cache, v_cache, block_table[(s + 2) * bt_stride], blk_stride);
/* Every (kind, head_dim) pair the dispatch names gets its own fully specialised copy of attend. */
#define ATTEND(KIND, DIM)                                                                                          \
    attend(qs, os, k_cache, v_cache, blocks, len, first, group, DIM, KIND, block_size, row_bytes, tok_stride,     \
           blk_stride, kh, score_scale)
#define ATTEND_KIND(KIND)                                                                                          \
    do {                                                                                                           \
        if (head_dim == 64) ATTEND(KIND, 64);                                                                      \
        else if (head_dim == 128) ATTEND(KIND, 128);                                                               \
        else ATTEND(KIND, head_dim);                                                                               \
    } while (0)
#if HAVE_BF16_DOT
        if (bf16_dot) {
            if (head_dim == 64)
                attend_bf16((const uint16_t *)q + q_at, os, k_cache, v_cache, blocks, len, first, group, 64,
                            block_size, row_bytes, tok_stride, blk_stride, kh, score_scale);
            else
                attend_bf16((const uint16_t *)q + q_at, os, k_cache, v_cache, blocks, len, first, group, head_dim,
                            block_size, row_bytes, tok_stride, blk_stride, kh, score_scale);
        } else
#endif
        if (kv_kind == KV_FP8) ATTEND_KIND(KV_FP8);
        else if (kv_kind == KV_INT8) ATTEND_KIND(KV_INT8);
        else if (kv_kind == KV_BF16) ATTEND_KIND(KV_BF16);
        else if (kv_kind == KV_F16) ATTEND_KIND(KV_F16);
        else ATTEND_KIND(KV_F32);
        if (tensor_scale_v != 1.f)
            for (int64_t i = 0; i < width; i++) os[i] *= tensor_scale_v;
        if (io_kind == KV_BF16) {
            uint16_t *o16 = (uint16_t *)out + out_at;
            for (int64_t i = 0; i < width; i++) o16[i] = float_to_bf16(obuf[i]);
        }
    }
    return 0;
}
