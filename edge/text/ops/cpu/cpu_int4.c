/* INT4 weight-only linear layer for the CPU, in float32 throughout.
 *
 * y[M, N] = x[M, K] @ W^T with W[n, k] = (code[n, k] - zero[n, k/G]) * scale[n, k/G]:
 * the checkpoint's own layout (two codes per byte, even k in the low nibble), its
 * float16 scales widened to float32 and its integer zero points. (code - zero) is an
 * integer in [-15, 15] and a scale has 11 significant bits, so every weight is exact in
 * float32 and only the float32 sums round: the answers are the quantized model's own,
 * on every CPU, unlike a kernel that rounds its inputs and outputs to bfloat16.
 *
 * Each output is summed in the same order whatever M is and however the rows are split
 * between threads, so a sequence's logits do not depend on its batch.
 *
 * Built on the box by edge/text/ops/cpu/cpu_int4.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes. GCC's vector types keep it portable: the compiler lowers them to the
 * machine's registers (AVX-512, AVX2, NEON).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16 /* floats per vector: one AVX-512 register, two AVX2 or four NEON ones */

typedef float vfloat __attribute__((vector_size(4 * LANES)));
typedef int32_t vint __attribute__((vector_size(4 * LANES)));
typedef uint8_t vbyte __attribute__((vector_size(LANES)));

static inline vfloat load_floats(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A vector's lanes summed in a fixed pairwise order (cpu_step.c sums with it too). */
static inline float sum_lanes(vfloat v) {
    float lane[LANES];
    memcpy(lane, &v, sizeof lane);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

/* `nb` weight rows times `r` activation rows, both constants where this is inlined, so
 * the nb * r * 2 sums stay in registers: each unpacked piece of weight meets r inputs and
 * each loaded input meets nb weight rows. Writes y[i * ldy + j] for activation row i and
 * weight row j. Low and high nibbles sum apart: two chains of adds that overlap, not one,
 * in every tile alike (a different order for some tiles would make a row's result depend
 * on its batch), so tiles of any shape give the same sums. A 2 x 4 tile (prefill) holds
 * 16 sums, 4 weights and 8 inputs, a 4 x 1 tile (decode) 8 sums, a 1 x 8 tile (a token
 * and its drafts) 16 sums: within AVX-512's 32 registers. */
static inline __attribute__((always_inline)) void tile(const int nb, const int r, const float *xe, const float *xo,
                                                       int64_t k2, int64_t groups, int64_t half_group,
                                                       const uint8_t *q, const float *scales, const uint8_t *zeros,
                                                       float *y, int64_t ldy) {
    vfloat acc_lo[4][8], acc_hi[4][8];
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < r; i++) acc_lo[j][i] = acc_hi[j][i] = (vfloat){0};
    for (int64_t g = 0; g < groups; g++) {
        /* code * s - z * s in one fused multiply-add is (code - z) * s exactly: the
         * weights are the model's to the last bit. */
        float s[4], sz[4];
        for (int j = 0; j < nb; j++) {
            s[j] = scales[j * groups + g];
            sz[j] = s[j] * (float)zeros[j * groups + g];
        }
        for (int64_t j0 = 0; j0 < half_group; j0 += LANES) {
            const int64_t at = g * half_group + j0;
            vfloat lo[4], hi[4];
            for (int j = 0; j < nb; j++) {
                vbyte b;
                memcpy(&b, q + j * k2 + at, sizeof b);
                /* Widened to int32 first: bytes straight to floats compile one by one. */
                lo[j] = __builtin_convertvector(__builtin_convertvector(b & 15, vint), vfloat) * s[j] - sz[j];
                hi[j] = __builtin_convertvector(__builtin_convertvector(b >> 4, vint), vfloat) * s[j] - sz[j];
            }
            for (int i = 0; i < r; i++) {
                const vfloat e = load_floats(xe + i * k2 + at);
                const vfloat o = load_floats(xo + i * k2 + at);
                for (int j = 0; j < nb; j++) {
                    acc_lo[j][i] += lo[j] * e;
                    acc_hi[j][i] += hi[j] * o;
                }
            }
        }
    }
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < r; i++) y[i * ldy + j] = sum_lanes(acc_lo[j][i] + acc_hi[j][i]);
}

#define TILE_FN(NB, R)                                                                                      \
    static void tile_##NB##_##R(const float *xe, const float *xo, int64_t k2, int64_t groups,             \
                                int64_t half_group, const uint8_t *q, const float *scales,                 \
                                const uint8_t *zeros, float *y, int64_t ldy) {                             \
        tile(NB, R, xe, xo, k2, groups, half_group, q, scales, zeros, y, ldy);                             \
    }
TILE_FN(2, 4)
TILE_FN(2, 3)
TILE_FN(2, 2)
TILE_FN(4, 1)
TILE_FN(1, 1)
TILE_FN(1, 2)
TILE_FN(1, 3)
TILE_FN(1, 4)
TILE_FN(1, 5)
TILE_FN(1, 6)
TILE_FN(1, 7)
TILE_FN(1, 8)

typedef void (*tile_fn)(const float *, const float *, int64_t, int64_t, int64_t, const uint8_t *, const float *,
                        const uint8_t *, float *, int64_t);
/* One weight row against r activation rows, r = 1..8: up to 8 (a decode step's batch,
 * a token and its drafts being verified) in one pass over the row's codes. */
static const tile_fn ONE_ROW[9] = {0, tile_1_1, tile_1_2, tile_1_3, tile_1_4, tile_1_5, tile_1_6, tile_1_7, tile_1_8};

/* Returns 0, -1 when K or G does not fit the kernel's tiling, -2 when out of memory. */
int edge_int4_linear(const float *x, int64_t m, int64_t k, const uint8_t *q, const float *scales,
                     const uint8_t *zeros, int64_t n, int64_t group, float *y, int threads) {
    if (group % (2 * LANES) != 0 || k % group != 0) return -1;
    const int64_t k2 = k / 2, groups = k / group, half_group = group / 2;
    /* Even and odd inputs apart, so each code's nibble meets its input in the same lane. */
    float *xe = malloc(sizeof(float) * (size_t)(m * k2));
    float *xo = malloc(sizeof(float) * (size_t)(m * k2));
    if (!xe || !xo) {
        free(xe);
        free(xo);
        return -2;
    }
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < k2; j++) {
            xe[i * k2 + j] = x[i * k + 2 * j];
            xo[i * k2 + j] = x[i * k + 2 * j + 1];
        }
    /* Four weight rows at a time. Up to 4 activation rows, or more than 8: two 2 x 4
     * tiles per 4 activation rows, then the rest (a 4 x 1 tile for one, two 2 x r tiles
     * for two or three). 5 to 8 rows: each weight row once against all of them. Weight
     * rows beyond a multiple of 4 one at a time, against up to 8 activation rows at once.
     * Whatever the tile, each output's sum runs in the same order. */
    const int64_t n4 = n / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n4 + n % 4; t++) {
        const int64_t row = t < n4 ? 4 * t : 4 * n4 + (t - n4);
        const uint8_t *qr = q + row * k2;
        const float *sr = scales + row * groups;
        const uint8_t *zr = zeros + row * groups;
        int64_t i = 0;
        if (t >= n4 || (m > 4 && m <= 8)) {
            const int64_t weight_rows = t < n4 ? 4 : 1;
            for (int64_t w = 0; w < weight_rows; w++)
                for (i = 0; i < m; i += 8) {
                    const int64_t r = m - i < 8 ? m - i : 8;
                    ONE_ROW[r](xe + i * k2, xo + i * k2, k2, groups, half_group, qr + w * k2, sr + w * groups,
                               zr + w * groups, y + i * n + row + w, n);
                }
            continue;
        }
        for (; i + 4 <= m; i += 4) {
            tile_2_4(xe + i * k2, xo + i * k2, k2, groups, half_group, qr, sr, zr, y + i * n + row, n);
            tile_2_4(xe + i * k2, xo + i * k2, k2, groups, half_group, qr + 2 * k2, sr + 2 * groups,
                     zr + 2 * groups, y + i * n + row + 2, n);
        }
        const tile_fn pair = m - i == 3 ? tile_2_3 : tile_2_2;
        if (m - i == 1) {
            tile_4_1(xe + i * k2, xo + i * k2, k2, groups, half_group, qr, sr, zr, y + i * n + row, n);
        } else if (m - i > 1) {
            pair(xe + i * k2, xo + i * k2, k2, groups, half_group, qr, sr, zr, y + i * n + row, n);
            pair(xe + i * k2, xo + i * k2, k2, groups, half_group, qr + 2 * k2, sr + 2 * groups, zr + 2 * groups,
                 y + i * n + row + 2, n);
        }
    }
    free(xe);
    free(xo);
    return 0;
}
