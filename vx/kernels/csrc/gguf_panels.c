/* GGUF rows as stored -> the int8-activation kernel's panel layout (quant_matmul_i8.c, and the AMX kernel's), for
 * a few hundred rows at a time: products of many rows of x (prefill) multiply a chunk of the weight in that layout,
 * where a panel of L features is reused across every row, while the weight itself stays as the file stores it.
 *
 * Each block is decoded into codes and per-group scale and zero, w = code * scale + zero exactly (the scales are
 * products of a float16 and a small integer: exact in float32), then scattered into
 *   4-bit (Q4_0, Q4_1, Q4_K; groups of 32): q[panel][k / 8][L][4] bytes, low nibble k = 8t + i, high nibble 8t + 4 + i
 *   8-bit (Q5_0, Q5_1, Q8_0, IQ4_XS, Q5_K groups of 32; Q6_K groups of 16): q[panel][k / 4][L][4] bytes holding
 *          code + 128
 *   sz[panel][group][scale | zero][L] float32
 * as vx/kernels/quant_matmul.py's `pack` lays out a weight for that kernel. Rows past N in the last panel are zero.
 * A type is a decode routine for one block and a row of FORMATS. Block layouts: csrc/gguf_kquant.c.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
       T_IQ4_XS = 23 };

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

/* Each decode_* routine: the block at w -> its codes (0..15 at 4 bits, code + 128 at 8), scale and zero per group. */

/* 32 weights of 16 bytes: weight l in the low nibble of byte l, l + 16 in the high one. */
static void nibbles32(const uint8_t *p, uint8_t *code) {
    for (int l = 0; l < 16; l++) code[l] = p[l] & 15, code[16 + l] = p[l] >> 4;
}

/* Q5_0 / Q5_1: the fifth bits (a little-endian uint32 at p, bit l for weight l) onto the nibbles, then + base. */
static void fifth_bits(const uint8_t *p, uint8_t *code, int base) {
    for (int l = 0; l < 32; l++) code[l] = (uint8_t)((code[l] | (((p[l / 8] >> (l % 8)) & 1) << 4)) + base);
}

static void decode_q4_0(const uint8_t *w, uint8_t *code, float *scale, float *zero) {
    nibbles32(w + 2, code);
    scale[0] = f16(w), zero[0] = -8.0f * scale[0];
}

static void decode_q4_1(const uint8_t *w, uint8_t *code, float *scale, float *zero) {
    nibbles32(w + 4, code);
    scale[0] = f16(w), zero[0] = f16(w + 2);
}

static void decode_q5_0(const uint8_t *w, uint8_t *code, float *scale, float *zero) { /* code: q - 16 + 128 */
    nibbles32(w + 6, code);
    fifth_bits(w + 2, code, 112);
    scale[0] = f16(w), zero[0] = 0.0f;
}

static void decode_q5_1(const uint8_t *w, uint8_t *code, float *scale, float *zero) {
    nibbles32(w + 8, code);
    fifth_bits(w + 4, code, 128);
    scale[0] = f16(w), zero[0] = f16(w + 2);
}

static void decode_q8_0(const uint8_t *w, uint8_t *code, float *scale, float *zero) {
    for (int l = 0; l < 32; l++) code[l] = w[2 + l] ^ 0x80; /* int8 + 128 */
    scale[0] = f16(w), zero[0] = 0.0f;
}

/* IQ4_XS: code V[nibble] + 128 (GGML's kvalues_iq4nl), sub-block j's scale d * (ls[j] - 32). */
static void decode_iq4_xs(const uint8_t *w, uint8_t *code, float *scale, float *zero) {
    static const int8_t values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    const float d = f16(w);
    for (int j = 0; j < 8; j++) {
        uint8_t *c = code + 32 * j;
        nibbles32(w + 8 + 16 * j, c);
        for (int l = 0; l < 32; l++) c[l] = (uint8_t)(values[c[l]] + 128);
        const int ls = ((w[4 + j / 2] >> (4 * (j % 2))) & 15) | (((w[2 + j / 4] >> (2 * (j % 4))) & 3) << 4);
        scale[j] = d * (float)(ls - 32), zero[j] = 0.0f;
    }
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

/* Q4_K (qh NULL) / Q5_K: nibbles at qs, fifth bits at qh. */
static void decode_k(const uint8_t *w, const uint8_t *qh, const uint8_t *qs, uint8_t *code, float *scale, float *zero) {
    const float d = f16(w), dmin = f16(w + 2);
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            code[64 * j + l] = qs[32 * j + l] & 15;
            code[64 * j + 32 + l] = qs[32 * j + l] >> 4;
        }
    if (qh)
        for (int s = 0; s < 8; s++)
            for (int l = 0; l < 32; l++) code[32 * s + l] = (code[32 * s + l] | (((qh[l] >> s) & 1) << 4)) + 128;
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k_scale_min(w + 4, j, &sc, &mn);
        scale[j] = d * (float)sc, zero[j] = -dmin * (float)mn;
    }
}

static void decode_q4_k(const uint8_t *w, uint8_t *code, float *scale, float *zero) {
    decode_k(w, NULL, w + 16, code, scale, zero);
}

static void decode_q5_k(const uint8_t *w, uint8_t *code, float *scale, float *zero) {
    decode_k(w, w + 16, w + 48, code, scale, zero);
}

/* Q6_K: q in 0..63, w = d * sc * (q - 32); code = q - 32 + 128. */
static void decode_q6_k(const uint8_t *w, uint8_t *code, float *scale, float *zero) {
    const uint8_t *ql = w, *qh = w + 128;
    const int8_t *sc = (const int8_t *)(w + 192);
    const float d = f16(w + 208);
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t a = ql[64 * h + l], e = ql[64 * h + 32 + l], hb = qh[32 * h + l];
            code[128 * h + l] = (a & 15) | ((hb & 3) << 4);
            code[128 * h + 32 + l] = (e & 15) | (((hb >> 2) & 3) << 4);
            code[128 * h + 64 + l] = (a >> 4) | (((hb >> 4) & 3) << 4);
            code[128 * h + 96 + l] = (e >> 4) | (((hb >> 6) & 3) << 4);
        }
    for (int i = 0; i < 256; i++) code[i] += 96;
    for (int g = 0; g < 16; g++) scale[g] = d * (float)sc[g], zero[g] = 0.0f;
}

/* A type's block of `bw` bytes and `bk` weights, the panels' bit width and group, and its decode routine. */
typedef struct {
    int type, bits;
    int64_t bw, bk, G;
    void (*decode)(const uint8_t *w, uint8_t *code, float *scale, float *zero);
} format;

static const format FORMATS[] = {
    {T_Q4_0, 4, 18, 32, 32, decode_q4_0},     {T_Q4_1, 4, 20, 32, 32, decode_q4_1},
    {T_Q5_0, 8, 22, 32, 32, decode_q5_0},     {T_Q5_1, 8, 24, 32, 32, decode_q5_1},
    {T_Q8_0, 8, 34, 32, 32, decode_q8_0},     {T_IQ4_XS, 8, 136, 256, 32, decode_iq4_xs},
    {T_Q4_K, 4, 144, 256, 32, decode_q4_k},   {T_Q5_K, 8, 176, 256, 32, decode_q5_k},
    {T_Q6_K, 8, 210, 256, 16, decode_q6_k},
};

static const format *format_of(int type) {
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++)
        if (FORMATS[i].type == type) return &FORMATS[i];
    return NULL;
}

/* The bit width (4 or 8) and group size the panels of `type` take, packed as bits * 1000 + group; -1 if none. */
int vx_gguf_panel_format(int type) {
    const format *f = format_of(type);
    return f ? f->bits * 1000 + (int)f->G : -1;
}

/* Rows 0..N of W (row r at w + r * ldw) into q and sz (as above, for ceil(N / L) panels of L features: q holds
 * K * L * bits / 8 bytes a panel, sz 2 * (K / G) * L floats). Returns 0, or -1 for an unserved type, bad sizes or
 * L not 4..64. */
int vx_gguf_to_i8_panels(const uint8_t *w, int64_t ldw, int type, int64_t N, int64_t K, int64_t L, uint8_t *q,
                         float *sz, int nthreads) {
    const format *f = format_of(type);
    if (!f || N <= 0 || K <= 0 || K % f->bk || ldw < K / f->bk * f->bw || L < 4 || L > 64) return -1;
    const int bits = f->bits;
    const int64_t G = f->G, ng = K / G, panels = (N + L - 1) / L, panel_bytes = K * L * bits / 8;
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
                    const uint8_t *row = w + n * ldw;
                    for (int64_t b = 0; b < K / f->bk; b++)
                        f->decode(row + b * f->bw, code + b * f->bk, scale + b * (f->bk / G), zero + b * (f->bk / G));
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
