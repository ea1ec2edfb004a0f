/* 2:4 sparse INT4 linear layer for the CPU, in float32 throughout.
 *
 * y[M, N] = x[M, K] @ W^T for a weight stored as edge/text/ops/sparse24.py lays it out:
 * per four inputs one byte of the two kept codes (low nibble the lower position) and a
 * nibble of their positions (2 bits each, ascending, the even four in a byte's low
 * nibble); scales and zero points per group of G inputs as the dense layout's. A kept
 * weight is (code - zero) * scale, a pruned one 0.
 *
 * Each chunk of 32 inputs of a weight row (8 code bytes, 4 position bytes: 12 bytes where
 * the dense layout reads 16) is expanded in registers into the dense kernel's two vectors,
 * the even and the odd inputs' weights, with +0 where a weight was pruned, and then meets
 * the activations exactly as in cpu_int4.c's tile: the same fused multiply-adds into the
 * same lanes, in the same order, summed by the same sum_lanes. A kept weight's float is
 * the dense kernel's (the same code * s - z * s, exact), and a pruned one's products are
 * +0 * x = +-0, which leave a sum as it was, as the dense kernel's +0 weights (code ==
 * zero point) do. So the outputs equal edge_int4_linear's on the dense codes of the same
 * weights bit for bit (tests/test_sparse24.py), for any batch and tiling, as long as the
 * activations are finite (0 * inf is NaN in both). The multiplies are not halved: on a
 * CPU a decode GEMV is bound by the bytes it streams, and gathering the kept activations
 * instead would both cost shuffles and change the summation order.
 *
 * GCC's vector types, as in cpu_int4.c: the compiler lowers them to AVX-512, AVX2 or NEON
 * registers, and to plain scalar code on a CPU with none. Built by
 * edge/text/ops/cpu/cpu_sparse24.py through cpu_int4.py's builder.
 */
#include "cpu_int4.c"

typedef int8_t vsbyte __attribute__((vector_size(LANES)));

/* Lane l of the even vector is input 2l of a 32-input chunk: four l / 2, position 2 (l & 1);
 * of the odd vector input 2l + 1: position 2 (l & 1) + 1. */
static const vbyte FOUR_OF_LANE = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
/* The position nibble of four f is in byte f / 2, low nibble for even f: index into
 * (low nibbles, high nibbles) as a two-vector shuffle's lanes. */
static const vbyte NIBBLE_OF_LANE = {0, 0, 16, 16, 1, 1, 17, 17, 2, 2, 18, 18, 3, 3, 19, 19};
static const vbyte EVEN_POS = {0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2};
static const vbyte ODD_POS = {1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3};

/* The dense weights (float32, pruned +0) of one chunk's lanes at positions `pos`. */
static inline vfloat expand(vbyte c0, vbyte c1, vbyte i0, vbyte i1, vbyte pos, float s, float sz) {
    const vbyte at0 = (vbyte)(i0 == pos), at1 = (vbyte)(i1 == pos);
    const vbyte code = (c0 & at0) | (c1 & at1);
    const vint kept = __builtin_convertvector((vsbyte)(at0 | at1), vint); /* -1 or 0 */
    const vfloat w = __builtin_convertvector(__builtin_convertvector(code, vint), vfloat) * s - sz;
    return (vfloat)((vint)w & kept);
}

static inline __attribute__((always_inline)) void sparse_tile(const int nb, const int r, const float *xe,
                                                              const float *xo, int64_t k2, int64_t groups,
                                                              int64_t half_group, const uint8_t *codes,
                                                              const uint8_t *index, const float *scales,
                                                              const uint8_t *zeros, float *y, int64_t ldy) {
    const int64_t k4 = k2 / 2, k8 = k2 / 4; /* bytes per row of codes and of positions */
    vfloat acc_lo[4][8], acc_hi[4][8];
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < r; i++) acc_lo[j][i] = acc_hi[j][i] = (vfloat){0};
    for (int64_t g = 0; g < groups; g++) {
        float s[4], sz[4];
        for (int j = 0; j < nb; j++) {
            s[j] = scales[j * groups + g];
            sz[j] = s[j] * (float)zeros[j * groups + g];
        }
        for (int64_t j0 = 0; j0 < half_group; j0 += LANES) {
            const int64_t at = g * half_group + j0; /* in the even/odd inputs' index: 32 inputs a step */
            vfloat lo[4], hi[4];
            for (int j = 0; j < nb; j++) {
                vbyte cb = {0}, ib = {0};
                memcpy(&cb, codes + j * k4 + at / 2, LANES / 2);
                memcpy(&ib, index + j * k8 + at / 4, LANES / 4);
                const vbyte c = __builtin_shuffle(cb, FOUR_OF_LANE);
                const vbyte nib = __builtin_shuffle(ib & 15, ib >> 4, NIBBLE_OF_LANE);
                const vbyte c0 = c & 15, c1 = c >> 4, i0 = nib & 3, i1 = nib >> 2;
                lo[j] = expand(c0, c1, i0, i1, EVEN_POS, s[j], sz[j]);
                hi[j] = expand(c0, c1, i0, i1, ODD_POS, s[j], sz[j]);
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

#define SPARSE_TILE_FN(NB, R)                                                                                \
    static void sparse_tile_##NB##_##R(const float *xe, const float *xo, int64_t k2, int64_t groups,         \
                                       int64_t half_group, const uint8_t *codes, const uint8_t *index,       \
                                       const float *scales, const uint8_t *zeros, float *y, int64_t ldy) {   \
        sparse_tile(NB, R, xe, xo, k2, groups, half_group, codes, index, scales, zeros, y, ldy);             \
    }
SPARSE_TILE_FN(2, 4)
SPARSE_TILE_FN(2, 3)
SPARSE_TILE_FN(2, 2)
SPARSE_TILE_FN(4, 1)
SPARSE_TILE_FN(1, 1)
SPARSE_TILE_FN(1, 2)
SPARSE_TILE_FN(1, 3)
SPARSE_TILE_FN(1, 4)
SPARSE_TILE_FN(1, 5)
SPARSE_TILE_FN(1, 6)
SPARSE_TILE_FN(1, 7)
SPARSE_TILE_FN(1, 8)

typedef void (*sparse_tile_fn)(const float *, const float *, int64_t, int64_t, int64_t, const uint8_t *,
                               const uint8_t *, const float *, const uint8_t *, float *, int64_t);
static const sparse_tile_fn SPARSE_ONE_ROW[9] = {0,
                                                 sparse_tile_1_1,
                                                 sparse_tile_1_2,
                                                 sparse_tile_1_3,
                                                 sparse_tile_1_4,
                                                 sparse_tile_1_5,
                                                 sparse_tile_1_6,
                                                 sparse_tile_1_7,
                                                 sparse_tile_1_8};

typedef struct {
    const float *xe, *xo;
    const uint8_t *codes, *index, *zeros;
    const float *scales;
    float *y;
    int64_t n, k2, groups, half_group;
} sparse_product;

static void sparse_call(const void *ctx, int64_t row, int nb, int64_t i, int r) {
    const sparse_product *P = ctx;
    const float *xe = P->xe + i * P->k2, *xo = P->xo + i * P->k2;
    const uint8_t *c = P->codes + row * (P->k2 / 2), *ix = P->index + row * (P->k2 / 4);
    const uint8_t *z = P->zeros + row * P->groups;
    const float *s = P->scales + row * P->groups;
    float *y = P->y + i * P->n + row;
    const sparse_tile_fn fn = nb == 1   ? SPARSE_ONE_ROW[r]
                              : nb == 4 ? sparse_tile_4_1
                              : r == 4  ? sparse_tile_2_4
                              : r == 3  ? sparse_tile_2_3
                                        : sparse_tile_2_2;
    fn(xe, xo, P->k2, P->groups, P->half_group, c, ix, s, z, y, P->n);
}

/* Returns 0, -1 when K or G does not fit the kernel's tiling, -2 when out of memory. The
 * same tiles as edge_int4_linear's (plan_tiles), so each output is summed alike. */
int edge_sparse24_linear(const float *x, int64_t m, int64_t k, const uint8_t *codes, const uint8_t *index,
                         const float *scales, const uint8_t *zeros, int64_t n, int64_t group, float *y,
                         int threads) {
    if (group % (2 * LANES) != 0 || k % group != 0) return -1;
    const int64_t k2 = k / 2, groups = k / group, half_group = group / 2;
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
    const int64_t n4 = n / 4;
    const sparse_product P = {xe, xo, codes, index, zeros, scales, y, n, k2, groups, half_group};
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n4 + n % 4; t++) plan_tiles(t, n4, m, sparse_call, &P);
    free(xe);
    free(xo);
    return 0;
}
