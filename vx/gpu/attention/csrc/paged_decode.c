/* Paged decode attention on the CPU: one query token per sequence, reading K/V in place from the paged cache.
 *
 * The torch backend otherwise gathers every context into a padded batch before SDPA, which triples the memory
 * traffic of a step that is memory-bound. Here each (sequence, kv head) task streams its blocks once, with an
 * online softmax over the block's tokens for the group of query heads that share the kv head (GQA).
 *
 * Layouts (all contiguous, float32):
 *   q, out:       rows of [H * D] (head-major, row strides q_stride / out_stride); sequence i's query is row
 *                 q_rows[i], its output row out_rows[i]
 *   k/v cache:    [num_blocks, block_size, Hk, D]
 *   block_table:  int32 [num_seqs, bt_stride]; seq_lens: int32 [num_seqs]
 * window > 0 limits attention to the last `window` positions (the query's own included), as in HF.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 32   /* query heads per kv head */
#define MAX_DIM 256    /* head_dim */
#define MAX_BLOCK 128  /* block_size */
#define NEG_BIG -1e30f /* the running max before any score: finite, since the file builds with -ffast-math */

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One (sequence, kv head) task. Always inlined, so that the dispatch below can give it a constant head_dim:
 * the compiler then unrolls the per-token dot products and vector updates completely. */
static inline __attribute__((always_inline)) void attend(
        const float *restrict qs, float *restrict os, const float *k_cache, const float *v_cache,
        const int32_t *blocks, int64_t len, int64_t first, int64_t group, const int64_t head_dim,
        int64_t block_size, int64_t tok_stride, int64_t blk_stride, int64_t kh, float scale) {
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP * MAX_DIM], p[MAX_GROUP * MAX_BLOCK];
    for (int64_t g = 0; g < group; g++) {
        m[g] = NEG_BIG;
        l[g] = 0.f;
        for (int64_t d = 0; d < head_dim; d++) acc[g * head_dim + d] = 0.f;
    }
    for (int64_t b = first / block_size; b * block_size < len; b++) {
        const int64_t t0 = b * block_size > first ? 0 : first - b * block_size;
        const int64_t t1 = (b + 1) * block_size <= len ? block_size : len - b * block_size;
        const float *kb = k_cache + blocks[b] * blk_stride + kh * head_dim;
        const float *vb = v_cache + blocks[b] * blk_stride + kh * head_dim;
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qs + g * head_dim;
            float *pg = p + g * block_size;
            float bmax = NEG_BIG;
            for (int64_t t = t0; t < t1; t++) {
                const float sc = dot(qg, kb + t * tok_stride, head_dim) * scale;
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
                const float w = pg[t];
                const float *vt = vb + t * tok_stride;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) ag[d] += w * vt[d];
            }
            m[g] = new_m;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < head_dim; d++) os[g * head_dim + d] = acc[g * head_dim + d] * inv;
    }
}

int vx_paged_decode_f32(const float *q, int64_t q_stride, const int64_t *q_rows, const float *k_cache,
                        const float *v_cache, const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, float scale, int64_t window, float *out, int64_t out_stride,
                        const int64_t *out_rows, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_DIM || block_size > MAX_BLOCK || num_heads % num_kv_heads) return -1;
    const int64_t tok_stride = num_kv_heads * head_dim;
    const int64_t blk_stride = block_size * tok_stride;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
        const int64_t s = task / num_kv_heads, kh = task % num_kv_heads;
        const int64_t len = seq_lens[s];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const float *qs = q + q_rows[s] * q_stride + kh * group * head_dim;
        float *os = out + out_rows[s] * out_stride + kh * group * head_dim;
        const int32_t *blocks = block_table + s * bt_stride;
        if (head_dim == 64)
            attend(qs, os, k_cache, v_cache, blocks, len, first, group, 64, block_size, tok_stride, blk_stride, kh,
                   scale);
        else if (head_dim == 128)
            attend(qs, os, k_cache, v_cache, blocks, len, first, group, 128, block_size, tok_stride, blk_stride, kh,
                   scale);
        else
            attend(qs, os, k_cache, v_cache, blocks, len, first, group, head_dim, block_size, tok_stride,
                   blk_stride, kh, scale);
    }
    return 0;
}
