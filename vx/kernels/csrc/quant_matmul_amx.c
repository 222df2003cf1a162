/* Weight-only integer matmuls for many rows on AMX tiles: y[M, N] = x[M, K] @ W^T, W[n, k] = q[n, k] * s[n, g] +
 * z[n, g] (g = k / G), for a weight packed in quant_matmul_i8.c's AVX-512 layout (panels of 16 features).
 *
 * Why: the int8-activation kernel's VNNI dot products are bound by compute once a step has many rows (a decode
 * batch of 32-128 requests), and an AMX tile multiply does 16 x 16 x 32 bf16 products in one instruction. Group
 * scales do not suit integer tiles (each group's int32 sums would need their own float epilogue), so each panel is
 * dequantized once per call into bf16 tiles (W exactly as float, rounded once to bf16) and multiplied by x rounded
 * to bf16, accumulating in float32: the error is that of a bf16 matmul, the engine's default dtype on such CPUs.
 * The dequantization costs the same at any M, so this path wins only above some rows; quant_matmul.py picks it.
 *
 * Tiles (palette 1, all 16 rows x 64 bytes): 0-3 accumulate a 32 x 32 block of y (two row blocks x two panels),
 * 4-5 hold x's two row blocks (16 rows x 32 k in bf16, laid out tile by tile), 6-7 the two panels' weights for those 32 k in the layout
 * `tdpbf16ps` reads: row r holds the pairs (k = 2r, 2r + 1) of each of the 16 features.
 * K must be a multiple of 32 (whole tiles); G a multiple of 8, as the int8 layout needs.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AI static inline __attribute__((always_inline))

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)

#define L 16   /* features per panel (the int8 layout's AVX-512 lanes) */
#define KT 32  /* k per tile */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Linux hands AMX's tile state to a process only once it asks (per process, so once is enough). 1 when granted. */
int vx_amx_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* Word i of the result: word 0 of dword i (i < 16), else word 1 of dword i - 16: the (k0, k1) pairs of the 16
 * features, then their (k2, k3) pairs. */
static const uint16_t PAIR_WORDS[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                        1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
/* Each feature's scale (or zero) twice, for features 0-7 and 8-15: the pairs' order in a tile row. */
static const int32_t TWICE_LO[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
static const int32_t TWICE_HI[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};

typedef struct {
    __m512 s_lo, s_hi, z_lo, z_hi;
} affine;

/* One tile row from 32 unsigned codes [f0 k0, f0 k1, f1 k0, ..., f15 k1]: codes * s + z in bf16. */
AI void emit_row(__m256i codes, const affine *a, uint16_t *out) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(codes)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(codes, 1)));
    lo = _mm512_fmadd_ps(lo, a->s_lo, a->z_lo);
    hi = _mm512_fmadd_ps(hi, a->s_hi, a->z_hi);
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* Two tile rows from 16 features x 4 consecutive k (one byte each, as the int8 layout's lanes). */
AI void emit_quad(__m512i quads, __m512i pair_words, const affine *a, uint16_t *out) {
    const __m512i pairs = _mm512_permutexvar_epi16(pair_words, quads);
    emit_row(_mm512_castsi512_si256(pairs), a, out);
    emit_row(_mm512_extracti64x4_epi64(pairs, 1), a, out + 2 * L);
}

/* A panel's weights over all of K into `out`: K / 2 tile rows of 32 bf16. */
AI void dequantize_panel(const uint8_t *panel, const void *sz, const int half, const int bits, int64_t K, int64_t G,
                         uint16_t *out) {
    const __m512i pair_words = _mm512_loadu_si512(PAIR_WORDS), nibble = _mm512_set1_epi8(0x0F);
    const __m512i twice_lo = _mm512_loadu_si512(TWICE_LO), twice_hi = _mm512_loadu_si512(TWICE_HI);
    const int64_t block_k = bits == 4 ? 8 : 4; /* k per 64-byte block of the layout */
    affine a;
    int64_t group = -1;
    for (int64_t t = 0; t < K / block_k; t++) {
        const int64_t g = t * block_k / G;
        if (g != group) {
            group = g;
            __m512 s, z;
            if (half) {
                const uint16_t *h = (const uint16_t *)sz + g * 2 * L;
                s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
                z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + L)));
            } else {
                s = _mm512_loadu_ps((const float *)sz + g * 2 * L);
                z = _mm512_loadu_ps((const float *)sz + g * 2 * L + L);
            }
            if (bits == 8) z = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s, z); /* codes are q + 128 */
            a.s_lo = _mm512_permutexvar_ps(twice_lo, s);
            a.s_hi = _mm512_permutexvar_ps(twice_hi, s);
            a.z_lo = _mm512_permutexvar_ps(twice_lo, z);
            a.z_hi = _mm512_permutexvar_ps(twice_hi, z);
        }
        const __m512i v = _mm512_loadu_si512(panel + t * 64);
        uint16_t *rows = out + t * (block_k / 2) * 2 * L;
        if (bits == 4) { /* low nibbles: k 8t..8t+3, high ones: 8t+4..8t+7 */
            emit_quad(_mm512_and_si512(v, nibble), pair_words, &a, rows);
            emit_quad(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), pair_words, &a, rows + 4 * L);
        } else {
            emit_quad(v, pair_words, &a, rows);
        }
    }
}

/* x in bf16, tile by tile: [rows_padded / 16][K / 32][16 rows][32 k], so that each tile load reads 1 KiB in a row
 * (loads of rows 2 KiB apart measured slower); the rows past M are zeros. */
static void rows_to_bf16(const float *x, int64_t M, int64_t K, int64_t rows_padded, uint16_t *out) {
    const int64_t tiles = K / KT;
    for (int64_t m = 0; m < rows_padded; m++) {
        uint16_t *row = out + (m / 16) * tiles * 16 * KT + (m % 16) * KT;
        for (int64_t t = 0; t < tiles; t++) {
            __m512i v = _mm512_setzero_si512();
            if (m < M) {
                const float *src = x + m * K + t * KT;
                v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
            }
            _mm512_storeu_si512(row + t * 16 * KT, v);
        }
    }
}

/* The 32 x 32 block of y at rows m0, panels p0 and p0 + 1 (the second one only if `two`), from tiles 0-3. */
AI void store_block(float *y, int64_t M, int64_t N, int64_t m0, int64_t p0, int two) {
    const int64_t n0 = p0 * L, rows = M - m0 < 32 ? M - m0 : 32, width = two ? 2 * L : L;
    const int64_t cols = N - n0 < width ? N - n0 : width;
    if (rows == 32 && cols == 2 * L) {
        _tile_stored(0, y + m0 * N + n0, N * 4);
        _tile_stored(1, y + m0 * N + n0 + L, N * 4);
        _tile_stored(2, y + (m0 + 16) * N + n0, N * 4);
        _tile_stored(3, y + (m0 + 16) * N + n0 + L, N * 4);
        return;
    }
    float block[32][2 * L];
    _tile_stored(0, &block[0][0], 2 * L * 4);
    _tile_stored(1, &block[0][L], 2 * L * 4);
    _tile_stored(2, &block[16][0], 2 * L * 4);
    _tile_stored(3, &block[16][L], 2 * L * 4);
    for (int64_t r = 0; r < rows; r++) memcpy(y + (m0 + r) * N + n0, block[r], cols * sizeof(float));
}

/* y[M, N] = x[M, K] @ W^T for a weight in quant_matmul_i8.c's 16-feature layout; returns 0, -1 for sizes this
 * kernel does not serve, -2 when scratch cannot be allocated. Call vx_amx_ready() once first. */
int vx_amx_matmul_f32(const float *x, int64_t M, int64_t K, const uint8_t *q, int bits, const void *sz, int sz_half,
                      int64_t N, int64_t G, float *y, int nthreads) {
    if (M < 0 || N < 0 || K <= 0 || K % KT || G <= 0 || G % 8 || K % G || (bits != 4 && bits != 8)) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t ng = K / G, panels = (N + L - 1) / L, panel_bytes = K * L * bits / 8;
    const int64_t sz_panel = ng * 2 * L * (sz_half ? 2 : 4), rows_padded = (M + 31) / 32 * 32;
    uint16_t *xb = aligned_alloc(64, rows_padded * K * sizeof(uint16_t));
    if (!xb) return -2;
    rows_to_bf16(x, M, K, rows_padded, xb);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        tile_config config = {0};
        config.palette_id = 1;
        for (int i = 0; i < 8; i++) config.rows[i] = 16, config.colsb[i] = 64;
        _tile_loadconfig(&config);
        /* The two panels' weights: K / 2 tile rows of 2 L bf16 each. */
        uint16_t *w = aligned_alloc(64, 2 * K * L * sizeof(uint16_t));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < (panels + 1) / 2; pair++) {
            if (!w) continue;
            const int64_t p0 = 2 * pair;
            const int two = p0 + 1 < panels;
            uint16_t *w0 = w, *w1 = w + K * L;
            for (int i = 0; i <= two; i++) {
                const int64_t p = p0 + i;
                const uint8_t *psz = (const uint8_t *)sz + p * sz_panel;
                uint16_t *out = i ? w1 : w0;
                if (bits == 4 && sz_half) dequantize_panel(q + p * panel_bytes, psz, 1, 4, K, G, out);
                else if (bits == 4) dequantize_panel(q + p * panel_bytes, psz, 0, 4, K, G, out);
                else if (sz_half) dequantize_panel(q + p * panel_bytes, psz, 1, 8, K, G, out);
                else dequantize_panel(q + p * panel_bytes, psz, 0, 8, K, G, out);
            }
            if (!two) w1 = w0; /* its products land in tiles 1 and 3, never stored */
            for (int64_t m0 = 0; m0 < rows_padded; m0 += 32) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t k0 = 0; k0 < K; k0 += KT) {
                    _tile_loadd(4, xb + m0 * K + k0 * 16, 2 * KT);
                    _tile_loadd(5, xb + (m0 + 16) * K + k0 * 16, 2 * KT);
                    _tile_loadd(6, w0 + k0 * L, 2 * L * 2);
                    _tile_loadd(7, w1 + k0 * L, 2 * L * 2);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                store_block(y, M, N, m0, p0, two);
            }
        }
        free(w);
        _tile_release();
    }
    free(xb);
    return failed ? -2 : 0;
}

int vx_amx_support(void) { return 1; }

#else /* no AMX bf16 in this build: quant_matmul.py keeps the int8 path */
int vx_amx_ready(void) { return 0; }
int vx_amx_support(void) { return 0; }
int vx_amx_matmul_f32(const float *x, int64_t M, int64_t K, const uint8_t *q, int bits, const void *sz, int sz_half,
                      int64_t N, int64_t G, float *y, int nthreads) {
    return -1;
}
#endif
