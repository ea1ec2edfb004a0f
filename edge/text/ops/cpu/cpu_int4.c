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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVXVNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#endif

#define LANES 16 /* floats per vector: one AVX-512 register, two AVX2 or four NEON ones */

typedef float vfloat __attribute__((vector_size(4 * LANES)));
typedef int32_t vint __attribute__((vector_size(4 * LANES)));
typedef uint8_t vbyte __attribute__((vector_size(LANES)));

static inline vfloat load_floats(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A vector's lanes summed in a fixed pairwise order (cpu_step.c sums with it too): lane l
 * gets lane l + 8, then l + 4, l + 2 and l + 1, as halves of the vector added. */
typedef float vhalf __attribute__((vector_size(2 * LANES)));
typedef float vquarter __attribute__((vector_size(LANES)));
static inline float sum_lanes(vfloat v) {
    vhalf h[2];
    memcpy(h, &v, sizeof h);
    const vhalf a = h[0] + h[1];
    vquarter q[2];
    memcpy(q, &a, sizeof q);
    const vquarter b = q[0] + q[1];
    return (b[0] + b[2]) + (b[1] + b[3]);
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

/* The tiles of one task of a product: four weight rows from `row` (t < n4), or one row
 * past the last multiple of four. Up to 4 activation rows, or more than 8: two 2 x 4
 * tiles per 4 activation rows, then the rest (a 4 x 1 tile for one, two 2 x r tiles for
 * two or three). 5 to 8 rows: each weight row once against all of them. A row past the
 * multiple of four against up to 8 activation rows at once. `call(ctx, row, nb, i, r)`
 * runs the nb x r tile of weight rows row.. and activation rows i..; each kernel's tiles
 * sum each output in the same order whatever the tile, so the plan changes no result. */
typedef void (*tile_call)(const void *ctx, int64_t row, int nb, int64_t i, int r);

static inline __attribute__((always_inline)) void plan_tiles(int64_t t, int64_t n4, int64_t m, tile_call call,
                                                             const void *ctx) {
    const int64_t row = t < n4 ? 4 * t : 4 * n4 + (t - n4);
    if (t >= n4 || (m > 4 && m <= 8)) {
        const int64_t weight_rows = t < n4 ? 4 : 1;
        for (int64_t w = 0; w < weight_rows; w++)
            for (int64_t i = 0; i < m; i += 8) call(ctx, row + w, 1, i, (int)(m - i < 8 ? m - i : 8));
        return;
    }
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
        call(ctx, row, 2, i, 4);
        call(ctx, row + 2, 2, i, 4);
    }
    if (m - i == 1) {
        call(ctx, row, 4, i, 1);
    } else if (m - i > 1) {
        call(ctx, row, 2, i, (int)(m - i));
        call(ctx, row + 2, 2, i, (int)(m - i));
    }
}

/* The float kernel's operands, for its tile calls. */
typedef struct {
    const float *xe, *xo;
    const uint8_t *q, *zeros;
    const float *scales;
    float *y;
    int64_t n, k2, groups, half_group;
} f32_product;

static void f32_tile(const void *ctx, int64_t row, int nb, int64_t i, int r) {
    const f32_product *P = ctx;
    const float *xe = P->xe + i * P->k2, *xo = P->xo + i * P->k2;
    const uint8_t *q = P->q + row * P->k2, *z = P->zeros + row * P->groups;
    const float *s = P->scales + row * P->groups;
    float *y = P->y + i * P->n + row;
    const tile_fn fn = nb == 1 ? ONE_ROW[r] : nb == 4 ? tile_4_1 : r == 4 ? tile_2_4 : r == 3 ? tile_2_3 : tile_2_2;
    fn(xe, xo, P->k2, P->groups, P->half_group, q, s, z, y, P->n);
}

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
    /* Four weight rows a task (plan_tiles), the tasks split between the threads. */
    const int64_t n4 = n / 4;
    const f32_product P = {xe, xo, q, zeros, scales, y, n, k2, groups, half_group};
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n4 + n % 4; t++) plan_tiles(t, n4, m, f32_tile, &P);
    free(xe);
    free(xo);
    return 0;
}

/* ---- The same products with 8-bit activations (models.qa.cpu_kernel: int8) ----
 *
 * Each activation row is rounded to int8 in blocks of 32 values, one float scale a
 * block (what llama.cpp does to the activations of its Q4 products), and the codes meet
 * it in integer dot products of four byte pairs at a time: AVX-512 VNNI's vpdpbusd,
 * AVX-VNNI's, AVX2's maddubs + madd, or Arm's sdot (Orin's Cortex-A78AE has it), else
 * plain C. The weights are the model's own; only the activations are rounded, to about
 * 1/254 of their block's largest value, so answers stray from the exact kernel's now and
 * then (bench/text.py measures how often: `exact_agreement`).
 *
 * A step covers 64 code bytes of a weight row (128 weights): sixteen 32-bit lanes, lane
 * l summing the products of bytes 4l..4l+3, i.e. weights 8l..8l+7 of the step (low
 * nibbles against the even activations, high against the odd). With the groups a power
 * of two of at least 32, a lane lies in one weight group and one activation block, so
 * each lane's integer sum is scaled once: by its group's scale times its block's. The
 * zero points come off at the end: sum over groups of scale * zero * (sum over the
 * group's blocks of block scale * sum of the block's int8 values).
 *
 * Integer sums are exact and each lane's float sums run in step order, so as in the
 * float kernel a row's outputs do not depend on its batch or its tile. */

#define STEP_BYTES 64
#define BLOCK 32 /* activation values per int8 scale */
/* A step's code bytes of the row this many rows on are fetched ahead: the integer products
 * are fast enough that the loads stall (the float kernel's arithmetic hides them), and a
 * matrix of short rows (576 inputs: 288 bytes) is too brief a stream for the hardware
 * prefetcher to ramp up on. Two weight tiles ahead; 4, 8 and 16 measured alike, and
 * without it the products took 1.4x as long (SmolLM2-135M's shapes, 2 threads, x86). */
#define PREFETCH_ROWS 8

typedef uint8_t vcodes __attribute__((vector_size(STEP_BYTES)));

/* Lane l of the result: sum over b < 4 of lo[4l + b] * e[4l + b] + hi[4l + b] * o[4l + b]
 * (codes unsigned, activations signed). */
static inline vint dot_step(vcodes lo, vcodes hi, const int8_t *e, const int8_t *o) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), (__m512i)lo, _mm512_loadu_si512(e));
    return (vint)_mm512_dpbusd_epi32(a, (__m512i)hi, _mm512_loadu_si512(o));
#elif defined(__AVXVNNI__) || defined(__AVX2__)
    int32_t out[16];
    const uint8_t *l = (const uint8_t *)&lo, *h = (const uint8_t *)&hi;
    for (int half = 0; half < 2; half++) {
        const __m256i cl = _mm256_loadu_si256((const __m256i *)(l + 32 * half));
        const __m256i ch = _mm256_loadu_si256((const __m256i *)(h + 32 * half));
        const __m256i xe = _mm256_loadu_si256((const __m256i *)(e + 32 * half));
        const __m256i xo = _mm256_loadu_si256((const __m256i *)(o + 32 * half));
#if defined(__AVXVNNI__)
        __m256i a = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), cl, xe);
        a = _mm256_dpbusd_avx_epi32(a, ch, xo);
#else
        /* Pairs of products as int16 (at most 2 * 15 * 127: no saturation), then fours. */
        const __m256i ones = _mm256_set1_epi16(1);
        const __m256i a = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(cl, xe), ones),
                                           _mm256_madd_epi16(_mm256_maddubs_epi16(ch, xo), ones));
#endif
        _mm256_storeu_si256((__m256i *)(out + 8 * half), a);
    }
    vint r;
    memcpy(&r, out, sizeof r);
    return r;
#elif defined(__ARM_FEATURE_DOTPROD)
    int32_t out[16];
    const uint8_t *l = (const uint8_t *)&lo, *h = (const uint8_t *)&hi;
    for (int q4 = 0; q4 < 4; q4++) {
        /* Codes are at most 15: as signed bytes they are the same numbers. */
        int32x4_t a = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(vld1q_u8(l + 16 * q4)), vld1q_s8(e + 16 * q4));
        a = vdotq_s32(a, vreinterpretq_s8_u8(vld1q_u8(h + 16 * q4)), vld1q_s8(o + 16 * q4));
        vst1q_s32(out + 4 * q4, a);
    }
    vint r;
    memcpy(&r, out, sizeof r);
    return r;
#else
    int32_t out[16];
    const uint8_t *l = (const uint8_t *)&lo, *h = (const uint8_t *)&hi;
    for (int lane = 0; lane < 16; lane++) {
        int32_t sum = 0;
        for (int b = 0; b < 4; b++) sum += l[4 * lane + b] * e[4 * lane + b] + h[4 * lane + b] * o[4 * lane + b];
        out[lane] = sum;
    }
    vint r;
    memcpy(&r, out, sizeof r);
    return r;
#endif
}

/* The weight scales of a step's 16 lanes: groups of 2^shift weights, the step starting
 * at group g0 (shift 5: four groups of four lanes; 6: two of eight; 7 and up: one). */
static inline vfloat lane_scales(const float *s, int64_t g0, int shift) {
    if (shift == 5) {
#if defined(__AVX512F__)
        const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        return (vfloat)_mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(s + g0)));
#else
        const float a = s[g0], b = s[g0 + 1], c = s[g0 + 2], d = s[g0 + 3];
        return (vfloat){a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d};
#endif
    }
    if (shift == 6) {
        const float a = s[g0], b = s[g0 + 1];
        return (vfloat){a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b};
    }
    return (vfloat){0} + s[g0];
}

/* LANES bytes widened to floats. */
static inline vfloat bytes_as_floats(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    float f[LANES];
    for (int l = 0; l < LANES; l++) f[l] = (float)p[l];
    return load_floats(f);
#endif
}

/* Activation rows in int8, laid out for the steps: row i's even and odd values apart
 * (e, o: `bytes` each, a whole number of steps, zero past K), each step's 16 lane block
 * scales (d), and per weight group the sum of its blocks' scale * value sums (cz, zero
 * past the row's groups up to a multiple of LANES). */
typedef struct {
    int8_t *e, *o;
    float *d, *cz;
    int64_t bytes, steps, cz_len;
} int8_rows;

static void free_rows(int8_rows *A) {
    free(A->e);
    free(A->o);
    free(A->d);
    free(A->cz);
}

static int quantize_rows(const float *x, int64_t m, int64_t k, int64_t group, int8_rows *A) {
    const int64_t groups = k / group;
    A->steps = (k / 2 + STEP_BYTES - 1) / STEP_BYTES;
    A->bytes = A->steps * STEP_BYTES;
    A->cz_len = (groups + LANES - 1) / LANES * LANES;
    A->e = calloc((size_t)(m * A->bytes), 1);
    A->o = calloc((size_t)(m * A->bytes), 1);
    A->d = calloc((size_t)(m * A->steps * LANES), sizeof(float));
    A->cz = calloc((size_t)(m * A->cz_len), sizeof(float));
    if (!A->e || !A->o || !A->d || !A->cz) return -2;
    for (int64_t i = 0; i < m; i++) {
        const float *xr = x + i * k;
        int8_t *e = A->e + i * A->bytes, *o = A->o + i * A->bytes;
        float *d = A->d + i * A->steps * LANES, *cz = A->cz + i * A->cz_len;
        for (int64_t b = 0; b < k / BLOCK; b++) {
            const float *v = xr + b * BLOCK;
            float top = 0.0f;
            for (int t = 0; t < BLOCK; t++) top = fmaxf(top, fabsf(v[t]));
            const float scale = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
            int32_t sum = 0;
            for (int t = 0; t < BLOCK; t += 2) {
                const int8_t qe = (int8_t)lrintf(v[t] * inv), qo = (int8_t)lrintf(v[t + 1] * inv);
                e[(b * BLOCK + t) / 2] = qe;
                o[(b * BLOCK + t) / 2] = qo;
                sum += qe + qo;
            }
            /* Block b is lanes 4(b % 4)..4(b % 4)+3 of step b / 4. */
            for (int l = 0; l < 4; l++) d[(b / 4) * LANES + (b % 4) * 4 + l] = scale;
            cz[b * BLOCK / group] += scale * (float)sum;
        }
    }
    return 0;
}

/* As tile() above, over int8 activation rows i0.. of A. The steps past K read the next
 * weight row's codes and scales (or a padded copy, for a matrix's last row) against
 * zero activations: they add nothing. */
static inline __attribute__((always_inline)) void tile8(const int nb, const int r, const int8_rows *A, int64_t i0,
                                                        int64_t k2, int64_t groups, int shift, const uint8_t *q,
                                                        const float *scales, const uint8_t *zeros, float *y,
                                                        int64_t ldy) {
    vfloat acc[4][8];
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < r; i++) acc[j][i] = (vfloat){0};
    for (int64_t c = 0; c < A->steps; c++) {
        const int64_t g0 = (c * 2 * STEP_BYTES) >> shift;
        vcodes lo[4], hi[4];
        vfloat s[4];
        for (int j = 0; j < nb; j++) {
            vcodes b;
            memcpy(&b, q + j * k2 + c * STEP_BYTES, sizeof b);
            __builtin_prefetch(q + (j + PREFETCH_ROWS) * k2 + c * STEP_BYTES);
            lo[j] = b & 15;
            hi[j] = b >> 4;
            s[j] = lane_scales(scales + j * groups, g0, shift);
        }
        for (int i = 0; i < r; i++) {
            const int64_t at = (i0 + i) * A->bytes + c * STEP_BYTES;
            const vfloat d = load_floats(A->d + ((i0 + i) * A->steps + c) * LANES);
            for (int j = 0; j < nb; j++)
                acc[j][i] += __builtin_convertvector(dot_step(lo[j], hi[j], A->e + at, A->o + at), vfloat) * (s[j] * d);
        }
    }
    for (int j = 0; j < nb; j++) {
        vfloat zt[8];
        for (int i = 0; i < r; i++) zt[i] = (vfloat){0};
        for (int64_t g = 0; g < A->cz_len; g += LANES) {
            const vfloat sz = load_floats(scales + j * groups + g) * bytes_as_floats(zeros + j * groups + g);
            for (int i = 0; i < r; i++) zt[i] += sz * load_floats(A->cz + (i0 + i) * A->cz_len + g);
        }
        for (int i = 0; i < r; i++) y[i * ldy + j] = sum_lanes(acc[j][i] - zt[i]);
    }
}

#define TILE8_FN(NB, R)                                                                                     \
    static void tile8_##NB##_##R(const int8_rows *A, int64_t i0, int64_t k2, int64_t groups, int shift,     \
                                 const uint8_t *q, const float *scales, const uint8_t *zeros, float *y,     \
                                 int64_t ldy) {                                                             \
        tile8(NB, R, A, i0, k2, groups, shift, q, scales, zeros, y, ldy);                                   \
    }
TILE8_FN(2, 4)
TILE8_FN(2, 3)
TILE8_FN(2, 2)
TILE8_FN(4, 1)
TILE8_FN(1, 1)
TILE8_FN(1, 2)
TILE8_FN(1, 3)
TILE8_FN(1, 4)
TILE8_FN(1, 5)
TILE8_FN(1, 6)
TILE8_FN(1, 7)
TILE8_FN(1, 8)

typedef void (*tile8_fn)(const int8_rows *, int64_t, int64_t, int64_t, int, const uint8_t *, const float *,
                         const uint8_t *, float *, int64_t);
static const tile8_fn ONE_ROW8[9] = {0,           tile8_1_1, tile8_1_2, tile8_1_3, tile8_1_4,
                                     tile8_1_5,   tile8_1_6, tile8_1_7, tile8_1_8};

static int log2_group(int64_t group) {
    int shift = 0;
    while (((int64_t)1 << shift) < group) shift++;
    return ((int64_t)1 << shift) == group && shift >= 5 ? shift : -1;
}


/* A weight as the int8 tiles read it: rows from `head` on come from a copy padded with
 * zeros (their last steps would read past the matrix). */
typedef struct {
    const uint8_t *q, *zeros, *tail_q, *tail_zeros;
    const float *scales, *tail_scales;
    int64_t head, k2, groups;
} int8_weight;

/* The int8 kernel's operands, for its tile calls. */
typedef struct {
    const int8_rows *A;
    const int8_weight *W;
    float *y;
    int64_t n;
    int shift;
} int8_product;

static void int8_tile(const void *ctx, int64_t row, int nb, int64_t i, int r) {
    const int8_product *P = ctx;
    const int8_weight *W = P->W;
    const int copied = row >= W->head; /* a tile lies wholly before the copy or in it */
    const int64_t at = copied ? row - W->head : row;
    const uint8_t *q = (copied ? W->tail_q : W->q) + at * W->k2;
    const float *s = (copied ? W->tail_scales : W->scales) + at * W->groups;
    const uint8_t *z = (copied ? W->tail_zeros : W->zeros) + at * W->groups;
    const tile8_fn fn = nb == 1 ? ONE_ROW8[r] : nb == 4 ? tile8_4_1 : r == 4 ? tile8_2_4 : r == 3 ? tile8_2_3 : tile8_2_2;
    fn(P->A, i, W->k2, W->groups, P->shift, q, s, z, P->y + i * P->n + row, P->n);
}

/* edge_int4_linear's product with the activations rounded to int8 (above). Returns 0, -1
 * where K or G does not fit, -2 when out of memory. */
int edge_int4_linear_int8(const float *x, int64_t m, int64_t k, const uint8_t *q, const float *scales,
                          const uint8_t *zeros, int64_t n, int64_t group, float *y, int threads) {
    const int shift = log2_group(group);
    if (shift < 0 || k % group != 0) return -1;
    if (m <= 0 || n <= 0) return 0;
    const int64_t k2 = k / 2, groups = k / group;
    int8_rows A;
    if (quantize_rows(x, m, k, group, &A) != 0) {
        free_rows(&A);
        return -2;
    }
    /* A row's last step reads up to A.bytes - k2 code bytes past it, its zero sums up to
     * cz_len - groups scales and zero points: those rows whose reads would pass the end
     * of the matrix, rounded to whole tiles of four, are read from a padded copy. */
    int64_t tail = 1;
    while (tail < n && ((tail + 1) * k2 < A.bytes || (tail + 1) * groups < A.cz_len)) tail++;
    const int64_t head = (n - tail) / 4 * 4, copied = n - head;
    uint8_t *tq = calloc((size_t)(copied * k2 + STEP_BYTES), 1);
    float *ts = calloc((size_t)(copied * groups + LANES), sizeof(float));
    uint8_t *tz = calloc((size_t)(copied * groups + LANES), 1);
    if (!tq || !ts || !tz) {
        free_rows(&A);
        free(tq);
        free(ts);
        free(tz);
        return -2;
    }
    memcpy(tq, q + head * k2, (size_t)(copied * k2));
    memcpy(ts, scales + head * groups, sizeof(float) * (size_t)(copied * groups));
    memcpy(tz, zeros + head * groups, (size_t)(copied * groups));
    const int8_weight W = {q, zeros, tq, tz, scales, ts, head, k2, groups};
    const int8_product P = {&A, &W, y, n, shift};
    const int64_t n4 = n / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n4 + n % 4; t++) plan_tiles(t, n4, m, int8_tile, &P);
    free_rows(&A);
    free(tq);
    free(ts);
    free(tz);
    return 0;
}

/* Per row of y [m, n]: the indices of its k largest entries, largest first (of equal
 * values the lower index first; a NaN is never among them), into idx [m, k]. The output
 * layer's exact top (Int4Linear._refine) asks for 16 of a vocabulary's logits at every
 * decode step: one pass keeping the k best in order rejects almost every entry with one
 * comparison, where torch's topk took longer than the step's own head product's tenth.
 * Returns 0, or -1 when k is not in 1..min(n, 64). */
int edge_top_k(const float *y, int64_t m, int64_t n, int k, int64_t *idx) {
    if (k < 1 || k > 64 || k > n) return -1;
    for (int64_t row = 0; row < m; row++) {
        const float *v = y + row * n;
        float best[64];
        int64_t at[64];
        int count = 0;
        for (int64_t j = 0; j < n; j++) {
            const float x = v[j];
            if (!(count < k ? x == x : x > best[count - 1])) continue; /* NaN, or not above the k-th */
            int i = count < k ? count++ : k - 1;
            while (i > 0 && best[i - 1] < x) {
                best[i] = best[i - 1];
                at[i] = at[i - 1];
                i--;
            }
            best[i] = x;
            at[i] = j;
        }
        for (int i = 0; i < k; i++) idx[row * k + i] = i < count ? at[i] : -1;
    }
    return 0;
}
