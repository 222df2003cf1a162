/* GGUF rows as stored -> the int8-activation kernel's panel layout (quant_matmul_i8.c, and the AMX kernel's), for
 * a few hundred rows at a time: products of many rows of x (prefill) multiply a chunk of the weight in that layout,
 * where a panel of L features is reused across every row, while the weight itself stays as the file stores it.
 *
 * Each row is decoded into codes and per-group scale and zero, w = code * scale + zero exactly (the scales are
 * products of a float16 and a small integer: exact in float32), then scattered into
 *   4-bit (Q4_0, Q4_K; groups of 32): q[panel][k / 8][L][4] bytes, low nibble k = 8t + i, high nibble 8t + 4 + i
 *   8-bit (Q8_0, Q5_K groups of 32; Q6_K groups of 16): q[panel][k / 4][L][4] bytes holding code + 128
 *   sz[panel][group][scale | zero][L] float32
 * as vx/kernels/quant_matmul.py's `pack` lays out a weight for that kernel. Rows past N in the last panel are zero.
 */
#include <stdint.h>
#include <string.h>

enum { T_Q4_0 = 2, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

static float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        const float v = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &v, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K / Q5_K: sub-block j's 6-bit scale and minimum. */
static void k_scale_min(const uint8_t *p, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = p[j] & 63;
        *mn = p[j + 4] & 63;
    } else {
        *sc = (p[j + 4] & 15) | ((p[j - 4] >> 6) << 4);
        *mn = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
    }
}

/* One row of N blocks: codes (0..15 at 4 bits, code + 128 at 8), scale and zero per group. */
static void decode_row(const uint8_t *w, int type, int64_t K, uint8_t *code, float *scale, float *zero) {
    switch (type) {
        case T_Q4_0:
            for (int64_t b = 0; b < K / 32; b++, w += 18) {
                const float d = f16(w);
                for (int l = 0; l < 16; l++) code[32 * b + l] = w[2 + l] & 15, code[32 * b + 16 + l] = w[2 + l] >> 4;
                scale[b] = d, zero[b] = -8.0f * d;
            }
            break;
        case T_Q8_0:
            for (int64_t b = 0; b < K / 32; b++, w += 34) {
                for (int l = 0; l < 32; l++) code[32 * b + l] = w[2 + l] ^ 0x80; /* int8 + 128 */
                scale[b] = f16(w), zero[b] = 0.0f;
            }
            break;
        case T_Q4_K:
        case T_Q5_K: {
            const int five = type == T_Q5_K, size = five ? 176 : 144;
            for (int64_t b = 0; b < K / 256; b++, w += size) {
                const float d = f16(w), dmin = f16(w + 2);
                const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
                uint8_t *c = code + 256 * b;
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++) {
                        c[64 * j + l] = qs[32 * j + l] & 15;
                        c[64 * j + 32 + l] = qs[32 * j + l] >> 4;
                    }
                if (five)
                    for (int s = 0; s < 8; s++)
                        for (int l = 0; l < 32; l++) c[32 * s + l] = (c[32 * s + l] | (((qh[l] >> s) & 1) << 4)) + 128;
                for (int j = 0; j < 8; j++) {
                    int sc, mn;
                    k_scale_min(w + 4, j, &sc, &mn);
                    scale[8 * b + j] = d * (float)sc, zero[8 * b + j] = -dmin * (float)mn;
                }
            }
            break;
        }
        default: /* T_Q6_K: q in 0..63, w = d * sc * (q - 32); code = q - 32 + 128 */
            for (int64_t b = 0; b < K / 256; b++, w += 210) {
                const uint8_t *ql = w, *qh = w + 128;
                const int8_t *sc = (const int8_t *)(w + 192);
                const float d = f16(w + 208);
                uint8_t *c = code + 256 * b;
                for (int h = 0; h < 2; h++)
                    for (int l = 0; l < 32; l++) {
                        const uint8_t a = ql[64 * h + l], e = ql[64 * h + 32 + l], hb = qh[32 * h + l];
                        c[128 * h + l] = (a & 15) | ((hb & 3) << 4);
                        c[128 * h + 32 + l] = (e & 15) | (((hb >> 2) & 3) << 4);
                        c[128 * h + 64 + l] = (a >> 4) | (((hb >> 4) & 3) << 4);
                        c[128 * h + 96 + l] = (e >> 4) | (((hb >> 6) & 3) << 4);
                    }
                for (int i = 0; i < 256; i++) c[i] += 96;
                for (int g = 0; g < 16; g++) scale[16 * b + g] = d * (float)sc[g], zero[16 * b + g] = 0.0f;
            }
            break;
    }
}

static int layout_of(int type, int64_t *bw, int64_t *bk, int *bits, int64_t *G) {
    switch (type) {
        case T_Q4_0: *bw = 18, *bk = 32, *bits = 4, *G = 32; return 0;
        case T_Q8_0: *bw = 34, *bk = 32, *bits = 8, *G = 32; return 0;
        case T_Q4_K: *bw = 144, *bk = 256, *bits = 4, *G = 32; return 0;
        case T_Q5_K: *bw = 176, *bk = 256, *bits = 8, *G = 32; return 0;
        case T_Q6_K: *bw = 210, *bk = 256, *bits = 8, *G = 16; return 0;
        default: return -1;
    }
}

/* The bit width (4 or 8) and group size the panels of `type` take, packed as bits * 1000 + group; -1 if none. */
int vx_gguf_panel_format(int type) {
    int64_t bw, bk, G;
    int bits;
    return layout_of(type, &bw, &bk, &bits, &G) ? -1 : bits * 1000 + (int)G;
}

/* Rows 0..N of W (row r at w + r * ldw) into q and sz (as above, for ceil(N / L) panels of L features: q holds
 * K * L * bits / 8 bytes a panel, sz 2 * (K / G) * L floats). Returns 0, or -1 for an unserved type, bad sizes or
 * L not 4..64. */
int vx_gguf_to_i8_panels(const uint8_t *w, int64_t ldw, int type, int64_t N, int64_t K, int64_t L, uint8_t *q,
                         float *sz, int nthreads) {
    int64_t bw, bk, G;
    int bits;
    if (layout_of(type, &bw, &bk, &bits, &G) || N <= 0 || K <= 0 || K % bk || ldw < K / bk * bw || L < 4 || L > 64)
        return -1;
    const int64_t ng = K / G, panels = (N + L - 1) / L, panel_bytes = K * L * bits / 8;
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t code[K];
        float scale[ng], zero[ng];
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            uint8_t *qp = q + p * panel_bytes;
            float *sp = sz + p * 2 * ng * L;
            for (int64_t j = 0; j < L; j++) {
                const int64_t n = p * L + j;
                if (n < N) {
                    decode_row(w + n * ldw, type, K, code, scale, zero);
                } else { /* padding: zero weights */
                    memset(code, bits == 8 ? 128 : 0, K);
                    memset(scale, 0, sizeof scale);
                    memset(zero, 0, sizeof zero);
                }
                for (int64_t g = 0; g < ng; g++) sp[(2 * g) * L + j] = scale[g], sp[(2 * g + 1) * L + j] = zero[g];
                if (bits == 8) {
                    for (int64_t t = 0; t < K / 4; t++) memcpy(qp + (t * L + j) * 4, code + 4 * t, 4);
                } else {
                    for (int64_t t = 0; t < K / 8; t++) {
                        uint8_t *o = qp + (t * L + j) * 4;
                        for (int i = 0; i < 4; i++) o[i] = code[8 * t + i] | (code[8 * t + 4 + i] << 4);
                    }
                }
            }
        }
    }
    return 0;
}
