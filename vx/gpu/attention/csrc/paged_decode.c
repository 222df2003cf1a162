/* Paged decode attention on the CPU: one query token per sequence, reading K/V in place from the paged cache.
 *
 * The torch backend otherwise gathers every context into a padded batch before SDPA, which triples the memory
 * traffic of a step that is memory-bound. Here each (sequence, kv head) task streams its blocks once, with an
 * online softmax over the block's tokens for the group of query heads that share the kv head (GQA).
 *
 * Layouts (all contiguous):
 *   q, out:       float32 rows of [H * D] (head-major, row strides q_stride / out_stride); sequence i's query is
 *                 row q_rows[i], its output row out_rows[i]
 *   k/v cache:    [num_blocks, block_size, Hk, row] where a row is one token's key (value) for one kv head, per
 *                 kv_kind (vx/gpu/attention/kv_format.py): KV_F32 D floats; KV_FP8 D float8 e4m3 codes; KV_INT8 D
 *                 int8 codes then the row's float32 scale. tensor_scale_k/v multiply every key/value (fp8's
 *                 per-tensor scale; 1 otherwise).
 *   block_table:  int32 [num_seqs, bt_stride]; seq_lens: int32 [num_seqs]
 * window > 0 limits attention to the last `window` positions (the query's own included), as in HF.
 * The 8-bit kinds are decoded in registers as the rows stream by: a quarter of the float32 cache's bytes cross
 * memory, and the scales are folded into the score (K) and the softmax weight (V) rather than into each element.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { KV_F32 = 0, KV_FP8 = 1, KV_INT8 = 2 };

#define MAX_GROUP 32   /* query heads per kv head */
#define MAX_DIM 256    /* head_dim */
#define MAX_BLOCK 128  /* block_size */
#define NEG_BIG -1e30f /* the running max before any score: finite, since the file builds with -ffast-math */

/* float8 e4m3fn -> float: sign, 4 exponent bits (bias 7), 3 mantissa bits, exponent 0 subnormal. Built from a
 * normal power of two, so it never makes a float subnormal (which a flush-to-zero process would zero). Integer ops
 * and a multiply: gcc vectorizes the loops that call it. */
static inline float fp8_e4m3_to_float(uint8_t code) {
    const int32_t e = (code >> 3) & 15, m = code & 7;
    const uint32_t pow2_bits = (uint32_t)((e > 1 ? e : 1) + 117) << 23; /* 2^(max(e, 1) - 10) */
    float pow2;
    memcpy(&pow2, &pow2_bits, sizeof pow2);
    const float x = (float)(e ? m + 8 : m) * pow2;
    return code & 0x80 ? -x : x;
}

/* The value at index i of a cache row of `kind` (its row scale not applied). */
static inline __attribute__((always_inline)) float row_value(const uint8_t *row, int64_t i, const int kind) {
    if (kind == KV_FP8) return fp8_e4m3_to_float(row[i]);
    if (kind == KV_INT8) return (float)((const int8_t *)row)[i];
    return ((const float *)row)[i];
}

/* The row's own scale: KV_INT8 keeps a float32 after its head_dim codes; the others have none. */
static inline __attribute__((always_inline)) float row_scale(const uint8_t *row, int64_t head_dim, const int kind) {
    if (kind != KV_INT8) return 1.f;
    float s;
    memcpy(&s, row + head_dim, sizeof s);
    return s;
}

static inline __attribute__((always_inline)) float dot(const float *restrict a, const uint8_t *restrict row,
                                                       int64_t n, const int kind) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * row_value(row, i, kind);
    return s;
}

/* One (sequence, kv head) task. Always inlined, so that the dispatch below can give it a constant head_dim and
 * kind: the compiler then unrolls the per-token dot products and vector updates completely. Strides in bytes. */
static inline __attribute__((always_inline)) void attend(
        const float *restrict qs, float *restrict os, const uint8_t *k_cache, const uint8_t *v_cache,
        const int32_t *blocks, int64_t len, int64_t first, int64_t group, const int64_t head_dim, const int kind,
        int64_t block_size, int64_t row_bytes, int64_t tok_stride, int64_t blk_stride, int64_t kh, float scale) {
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP * MAX_DIM], p[MAX_GROUP * MAX_BLOCK];
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
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qs + g * head_dim;
            float *pg = p + g * block_size;
            float bmax = NEG_BIG;
            for (int64_t t = t0; t < t1; t++) {
                const uint8_t *kt = kb + t * tok_stride;
                const float sc = dot(qg, kt, head_dim, kind) * (scale * row_scale(kt, head_dim, kind));
                pg[t] = sc;
                bmax = sc > bmax ? sc : bmax;
            }
            const float new_m = bmax > m[g] ? bmax : m[g];
            const float correction = expf(m[g] - new_m); /* 0 on the first block */
            float bsum = 0.f;
            /* A separate loop, so that the compiler calls the vector expf (libmvec). */
#pragma omp simd reduction(+ : bsum)
            for (int64_t t = t0; t < t1; t++) {
                pg[t] = expf(pg[t] - new_m);
                bsum += pg[t];
            }
            float *ag = acc + g * head_dim;
            l[g] = l[g] * correction + bsum;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) ag[d] *= correction;
            for (int64_t t = t0; t < t1; t++) {
                const uint8_t *vt = vb + t * tok_stride;
                const float w = pg[t] * row_scale(vt, head_dim, kind);
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) ag[d] += w * row_value(vt, d, kind);
            }
            m[g] = new_m;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < head_dim; d++) os[g * head_dim + d] = acc[g * head_dim + d] * inv;
    }
}

int vx_paged_decode(const float *q, int64_t q_stride, const int64_t *q_rows, const uint8_t *k_cache,
                    const uint8_t *v_cache, int64_t kv_kind, int64_t row_bytes, float tensor_scale_k,
                    float tensor_scale_v, const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                    float scale, int64_t window, float *out, int64_t out_stride, const int64_t *out_rows,
                    int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_DIM || block_size > MAX_BLOCK || num_heads % num_kv_heads) return -1;
    if (kv_kind < KV_F32 || kv_kind > KV_INT8) return -1;
    const int64_t tok_stride = num_kv_heads * row_bytes;
    const int64_t blk_stride = block_size * tok_stride;
    const float score_scale = scale * tensor_scale_k;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
        const int64_t s = task / num_kv_heads, kh = task % num_kv_heads;
        const int64_t len = seq_lens[s];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const float *qs = q + q_rows[s] * q_stride + kh * group * head_dim;
        float *os = out + out_rows[s] * out_stride + kh * group * head_dim;
        const int32_t *blocks = block_table + s * bt_stride;
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
        if (kv_kind == KV_FP8) ATTEND_KIND(KV_FP8);
        else if (kv_kind == KV_INT8) ATTEND_KIND(KV_INT8);
        else ATTEND_KIND(KV_F32);
        if (tensor_scale_v != 1.f)
            for (int64_t i = 0; i < group * head_dim; i++) os[i] *= tensor_scale_v;
    }
    return 0;
}
