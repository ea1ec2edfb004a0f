/* Attention over a quantized KV cache for the CPU, reading the codes as they are stored.
 *
 * The cache (edge/text/kv/quant_cache.py) holds each row's oldest tokens as int8 or int4
 * codes and its newest in float32 (the float window and the key block not yet full):
 *   keys:   code[t, d] * kscale[t / KB, d] (+ kzero[t / KB, d] for int4): a scale per
 *           channel over a block of KB tokens;
 *   values: code[t, d] * vscale[t, d / VG] (+ vzero[t, d / VG] for int4, or, with no
 *           zero points, (code - 8) * vscale): a scale per token and group of VG channels;
 *   int4 codes pack two channels a byte, the even channel in the low nibble.
 * Nothing is dequantized into a buffer: a query is first multiplied by a block's key
 * scales (so a score is one product of codes with those scaled queries, plus the
 * query's product with the zero points), and a value's scale is folded into its
 * softmax weight.
 *
 * The first `sink` positions of a row are kept float (sk, sv) and read instead of their
 * codes once they are coded.
 *
 * Position t's codes are in slot t % code_len and key block b's scales in slot b % blocks:
 * a sliding layer keeps only its window's key blocks, a circle the window moves round
 * (quant_cache.py); a layer holding every position has a slot for each, so the same
 * arithmetic reads it in place.
 *
 * Query i (of Q) attends to positions 0..pos[i] of cache row rows[i]: positions below
 * coded[i] from the codes, the rest from the float part, where position t is slot
 * (t - fbase[i]) % fmod of float row frows[i]: the ring of the cache's newest tokens
 * (fbase 0, fmod its length) or a contiguous run of float tokens starting at fbase.
 *
 * Built on the box by edge/text/ops/cpu/cpu_kv.py (cc -O3 -march=native -fopenmp, as
 * cpu_int4.c) and called through ctypes. Each (query, KV head) pair is summed in the
 * same order whatever the batch, so a sequence's answer does not depend on it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

typedef struct {
    int64_t nkv, d, code_len, blocks, groups; /* code slots, key-block slots, value groups per token */
    int64_t kb, vg;
    int int4;
    const void *kcodes, *vcodes;            /* [rows, nkv, code_len, d or d/2] */
    const uint16_t *kscale, *kzero;         /* [rows, nkv, blocks, d] float16 */
    const uint16_t *vscale, *vzero;         /* [rows, nkv, code_len, groups] float16 */
    const float *kf, *vf;                   /* [frows, nkv, falloc, d] float32 */
    int64_t falloc, fmod;
    const float *sk, *sv;                   /* [rows, nkv, sink, d] float32: the first tokens */
    int64_t sink;
    int64_t window;                         /* a sliding layer's window (0: every position) */
} kv_layer;

/* One query's `group` heads (q [group, d], pre-scaled) against KV head h of row `row`:
 * out [group, d]. `scores` holds group * (pos + 1) floats, `work` d. */
static void attend_one(const kv_layer *L, const float *q, int group, int64_t row, int64_t h, int64_t pos,
                       int64_t coded, int64_t frow, int64_t fbase, float *out, float *scores, float *work) {
    const int64_t d = L->d, n = pos + 1;
    /* A sliding layer's query sees itself and the window - 1 positions before it. */
    const int64_t lo = L->window > 0 && pos + 1 > L->window ? pos + 1 - L->window : 0;
    const int64_t dc = L->int4 ? d / 2 : d;
    const int64_t head = row * L->nkv + h;
    const int64_t fhead = frow * L->nkv + h;
    if (coded > n) coded = n;
    float *qs = work; /* a block's keys' scales times the query */
    for (int g = 0; g < group; g++) {
        const float *qg = q + g * d;
        float *sg = scores + g * n;
        for (int64_t b0 = lo / L->kb * L->kb; b0 < coded; b0 += L->kb) {
            const int64_t blk = b0 / L->kb % L->blocks;
            const uint16_t *ks = L->kscale + (head * L->blocks + blk) * d;
            float zterm = 0.0f;
            for (int64_t c = 0; c < d; c++) qs[c] = qg[c] * half_to_float(ks[c]);
            if (L->int4) {
                const uint16_t *kz = L->kzero + (head * L->blocks + blk) * d;
                for (int64_t c = 0; c < d; c++) zterm += qg[c] * half_to_float(kz[c]);
            }
            const int64_t b1 = b0 + L->kb < coded ? b0 + L->kb : coded;
            for (int64_t t = b0 > lo ? b0 : lo; t < b1; t++) {
                float s = 0.0f;
                const int64_t at = head * L->code_len + t % L->code_len;
                if (L->int4) {
                    const uint8_t *code = (const uint8_t *)L->kcodes + at * dc;
                    for (int64_t j = 0; j < dc; j++)
                        s += qs[2 * j] * (float)(code[j] & 15) + qs[2 * j + 1] * (float)(code[j] >> 4);
                } else {
                    const int8_t *code = (const int8_t *)L->kcodes + at * dc;
                    for (int64_t c = 0; c < d; c++) s += qs[c] * (float)code[c];
                }
                sg[t] = s + zterm;
            }
        }
        const int64_t sunk = L->sink < coded ? L->sink : coded; /* coded, but read float */
        for (int64_t t = lo; t < sunk; t++) {
            const float *k = L->sk + (head * L->sink + t) * d;
            float s = 0.0f;
            for (int64_t c = 0; c < d; c++) s += qg[c] * k[c];
            sg[t] = s;
        }
        const int64_t first_float = coded > lo ? coded : lo;
        for (int64_t t = first_float; t < n; t++) {
            const int64_t slot = (t - fbase) % L->fmod;
            const float *k = L->kf + (fhead * L->falloc + slot) * d;
            float s = 0.0f;
            for (int64_t c = 0; c < d; c++) s += qg[c] * k[c];
            sg[t] = s;
        }
        float m = -INFINITY;
        for (int64_t t = lo; t < n; t++) m = sg[t] > m ? sg[t] : m;
        float sum = 0.0f;
        for (int64_t t = lo; t < n; t++) {
            sg[t] = expf(sg[t] - m);
            sum += sg[t];
        }
        const float inv = 1.0f / sum;
        float *og = out + g * d;
        for (int64_t c = 0; c < d; c++) og[c] = 0.0f;
        for (int64_t t = lo; t < sunk; t++) {
            const float p = sg[t] * inv;
            const float *v = L->sv + (head * L->sink + t) * d;
            for (int64_t c = 0; c < d; c++) og[c] += p * v[c];
        }
        for (int64_t t = sunk > lo ? sunk : lo; t < coded; t++) {
            const float p = sg[t] * inv;
            const int64_t at = head * L->code_len + t % L->code_len;
            const uint16_t *vs = L->vscale + at * L->groups;
            for (int64_t gi = 0; gi < L->groups; gi++) {
                const float w = p * half_to_float(vs[gi]);
                const int64_t c0 = gi * L->vg;
                if (L->int4) {
                    const uint8_t *code = (const uint8_t *)L->vcodes + at * dc + c0 / 2;
                    /* no zero points: symmetric codes, c standing for (c - 8) steps */
                    const float z = L->vzero ? p * half_to_float(L->vzero[at * L->groups + gi]) : -8.0f * w;
                    for (int64_t j = 0; j < L->vg / 2; j++) {
                        og[c0 + 2 * j] += w * (float)(code[j] & 15) + z;
                        og[c0 + 2 * j + 1] += w * (float)(code[j] >> 4) + z;
                    }
                } else {
                    const int8_t *code = (const int8_t *)L->vcodes + at * dc + c0;
                    for (int64_t c = 0; c < L->vg; c++) og[c0 + c] += w * (float)code[c];
                }
            }
        }
        for (int64_t t = first_float; t < n; t++) {
            const float p = sg[t] * inv;
            const int64_t slot = (t - fbase) % L->fmod;
            const float *v = L->vf + (fhead * L->falloc + slot) * d;
            for (int64_t c = 0; c < d; c++) og[c] += p * v[c];
        }
    }
}

/* q [Q, nh, d] float32 (not yet scaled: times q_scale, or 1/sqrt(d) where it is 0) -> out
 * [Q, nh, d] float32, each query seeing its last `window` positions (0: all). Returns 0,
 * or -1 on a bad shape or an allocation failure. */
int edge_kv_attention(const float *q, int64_t nq, int64_t nh, const int64_t *rows, const int64_t *pos,
                      const int64_t *coded, const int64_t *frows, const int64_t *fbase, int64_t nkv, int64_t d,
                      int64_t code_len, int64_t kb, int64_t vg, int int4, const void *kcodes, const void *kscale,
                      const void *kzero, const void *vcodes, const void *vscale, const void *vzero, const float *kf,
                      const float *vf, int64_t falloc, int64_t fmod, const float *sk, const float *sv,
                      int64_t sink, int64_t window, float q_scale, float *out, int threads) {
    if (nkv <= 0 || nh % nkv || d <= 0 || kb <= 0 || vg <= 0 || d % vg || (int4 && (d % 2 || vg % 2)) || fmod <= 0 ||
        window < 0 || code_len <= 0 || code_len % kb)
        return -1;
    kv_layer L = {nkv,    d,     code_len, (code_len + kb - 1) / kb, d / vg, kb, vg, int4, kcodes, vcodes,
                  kscale, kzero, vscale,   vzero,                     kf,     vf, falloc, fmod, sk, sv, sink, window};
    const int group = (int)(nh / nkv);
    const float scale = q_scale > 0.0f ? q_scale : 1.0f / sqrtf((float)d);
    int64_t longest = 0;
    for (int64_t i = 0; i < nq; i++) longest = pos[i] + 1 > longest ? pos[i] + 1 : longest;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * longest + d * group + d));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float *qg = scores + group * longest;
            float *work = qg + d * group;
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < nq * nkv; task++) {
                const int64_t i = task / nkv, h = task % nkv;
                for (int64_t c = 0; c < group * d; c++) qg[c] = q[(i * nh + h * group) * d + c] * scale;
                attend_one(&L, qg, group, rows[i], h, pos[i], coded[i], frows[i], fbase[i],
                           out + (i * nh + h * group) * d, scores, work);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
