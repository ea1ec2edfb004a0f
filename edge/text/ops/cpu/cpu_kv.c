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
 * Sparse attention (models.qa.sparse_attention; Quest: Tang et al., 2024) in a layer that sees
 * every position: given the cache's block summaries (per row, KV head and block of
 * block_tokens positions, the per-channel min and max of the keys as this kernel reads
 * them: decoded codes, the sink's and the ring's floats; quant_cache.py keeps them) a
 * query selects blocks by the float decode step's rule (cpu_select.c, shared) and attends
 * to the selected blocks' coded positions and to every float position after them.
 *
 * Built on the box by edge/text/ops/cpu/cpu_kv.py (cc -O3 -march=native -fopenmp, as
 * cpu_int4.c) and called through ctypes. Each (query, KV head) pair is summed in the
 * same order whatever the batch, so a sequence's answer does not depend on it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_select.c"

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
    const float *summary;                   /* sparse attention's block summaries [rows, nkv, sblocks,
                                               2 (min, max), d] float32, or NULL (dense) */
    int64_t sblocks, block_tokens;
} kv_layer;

/* One query's `group` heads (q [group, d], pre-scaled) against KV head h of row `row`:
 * out [group, d], over the positions of `spans` (first..last pairs, ascending, within
 * lo..pos: dense attention is the one span lo..pos). Every sum runs over the positions in
 * ascending order whatever the spans (sink, then codes, then float, each position's score
 * the same products), so a sparse call whose spans cover every position is the dense one
 * to the bit. `scores` holds group * (pos + 1) floats, `work` d. */
static void attend_one(const kv_layer *L, const float *q, int group, int64_t row, int64_t h, int64_t pos,
                       int64_t coded, int64_t frow, int64_t fbase, const int64_t *spans, int64_t nspans, float *out,
                       float *scores, float *work) {
    const int64_t d = L->d, n = pos + 1;
    const int64_t dc = L->int4 ? d / 2 : d;
    const int64_t head = row * L->nkv + h;
    const int64_t fhead = frow * L->nkv + h;
    if (coded > n) coded = n;
    const int64_t sunk = L->sink < coded ? L->sink : coded; /* coded, but read float */
    float *qs = work; /* a block's keys' scales times the query */
    for (int g = 0; g < group; g++) {
        const float *qg = q + g * d;
        float *sg = scores + g * n;
        for (int64_t s = 0; s < nspans; s++) {
            const int64_t a = spans[2 * s], z = spans[2 * s + 1] + 1;
            const int64_t cz = z < coded ? z : coded;
            for (int64_t b0 = a / L->kb * L->kb; b0 < cz; b0 += L->kb) {
                const int64_t blk = b0 / L->kb % L->blocks;
                const uint16_t *ks = L->kscale + (head * L->blocks + blk) * d;
                float zterm = 0.0f;
                for (int64_t c = 0; c < d; c++) qs[c] = qg[c] * half_to_float(ks[c]);
                if (L->int4) {
                    const uint16_t *kz = L->kzero + (head * L->blocks + blk) * d;
                    for (int64_t c = 0; c < d; c++) zterm += qg[c] * half_to_float(kz[c]);
                }
                const int64_t b1 = b0 + L->kb < cz ? b0 + L->kb : cz;
                for (int64_t t = b0 > a ? b0 : a; t < b1; t++) {
                    float sc = 0.0f;
                    const int64_t at = head * L->code_len + t % L->code_len;
                    if (L->int4) {
                        const uint8_t *code = (const uint8_t *)L->kcodes + at * dc;
                        for (int64_t j = 0; j < dc; j++)
                            sc += qs[2 * j] * (float)(code[j] & 15) + qs[2 * j + 1] * (float)(code[j] >> 4);
                    } else {
                        const int8_t *code = (const int8_t *)L->kcodes + at * dc;
                        for (int64_t c = 0; c < d; c++) sc += qs[c] * (float)code[c];
                    }
                    sg[t] = sc + zterm;
                }
            }
            const int64_t sz = z < sunk ? z : sunk;
            for (int64_t t = a; t < sz; t++) {
                const float *k = L->sk + (head * L->sink + t) * d;
                float sc = 0.0f;
                for (int64_t c = 0; c < d; c++) sc += qg[c] * k[c];
                sg[t] = sc;
            }
            for (int64_t t = a > coded ? a : coded; t < z; t++) {
                const int64_t slot = (t - fbase) % L->fmod;
                const float *k = L->kf + (fhead * L->falloc + slot) * d;
                float sc = 0.0f;
                for (int64_t c = 0; c < d; c++) sc += qg[c] * k[c];
                sg[t] = sc;
            }
        }
        float m = -INFINITY;
        for (int64_t s = 0; s < nspans; s++)
            for (int64_t t = spans[2 * s]; t <= spans[2 * s + 1]; t++) m = sg[t] > m ? sg[t] : m;
        float sum = 0.0f;
        for (int64_t s = 0; s < nspans; s++)
            for (int64_t t = spans[2 * s]; t <= spans[2 * s + 1]; t++) {
                sg[t] = expf(sg[t] - m);
                sum += sg[t];
            }
        const float inv = 1.0f / sum;
        float *og = out + g * d;
        for (int64_t c = 0; c < d; c++) og[c] = 0.0f;
        for (int64_t s = 0; s < nspans; s++) {
            const int64_t a = spans[2 * s], z = spans[2 * s + 1] + 1;
            const int64_t sz = z < sunk ? z : sunk, cz = z < coded ? z : coded;
            for (int64_t t = a; t < sz; t++) {
                const float p = sg[t] * inv;
                const float *v = L->sv + (head * L->sink + t) * d;
                for (int64_t c = 0; c < d; c++) og[c] += p * v[c];
            }
            for (int64_t t = a > sunk ? a : sunk; t < cz; t++) {
                const float p = sg[t] * inv;
                const int64_t at = head * L->code_len + t % L->code_len;
                const uint16_t *vs = L->vscale + at * L->groups;
                for (int64_t gi = 0; gi < L->groups; gi++) {
                    const float w = p * half_to_float(vs[gi]);
                    const int64_t c0 = gi * L->vg;
                    if (L->int4) {
                        const uint8_t *code = (const uint8_t *)L->vcodes + at * dc + c0 / 2;
                        /* no zero points: symmetric codes, c standing for (c - 8) steps */
                        const float zp = L->vzero ? p * half_to_float(L->vzero[at * L->groups + gi]) : -8.0f * w;
                        for (int64_t j = 0; j < L->vg / 2; j++) {
                            og[c0 + 2 * j] += w * (float)(code[j] & 15) + zp;
                            og[c0 + 2 * j + 1] += w * (float)(code[j] >> 4) + zp;
                        }
                    } else {
                        const int8_t *code = (const int8_t *)L->vcodes + at * dc + c0;
                        for (int64_t c = 0; c < L->vg; c++) og[c0 + c] += w * (float)code[c];
                    }
                }
            }
            for (int64_t t = a > coded ? a : coded; t < z; t++) {
                const float p = sg[t] * inv;
                const int64_t slot = (t - fbase) % L->fmod;
                const float *v = L->vf + (fhead * L->falloc + slot) * d;
                for (int64_t c = 0; c < d; c++) og[c] += p * v[c];
            }
        }
    }
}

/* The spans query i attends to: lo..pos densely, or, where it selects (`k` >= 0 over
 * summaries), the blocks select_spans (cpu_select.c: the float step's rule) keeps of
 * the coded positions and every float one after them (the ring: read whole anyway, and
 * the newest tokens). q [group, d] unscaled, as the float step selects by. score and keep
 * hold sblocks each; spans 2 * (sblocks + 1). Returns how many spans. */
static int64_t attended(const kv_layer *L, const float *q, int group, int64_t row, int64_t h, int64_t pos,
                        int64_t coded, int64_t k, float *score, unsigned char *keep, int64_t *spans) {
    const int64_t lo = L->window > 0 && pos + 1 > L->window ? pos + 1 - L->window : 0;
    if (!L->summary || k < 0 || L->window > 0) { /* a sliding layer: its window bounds it already */
        spans[0] = lo;
        spans[1] = pos;
        return 1;
    }
    if (coded > pos + 1) coded = pos + 1;
    const float *summary = L->summary + (row * L->nkv + h) * L->sblocks * 2 * L->d;
    const int64_t chosen = select_spans(q, group, L->d, summary, pos, L->block_tokens, k, score, keep, spans);
    int64_t n = 0;
    for (int64_t s = 0; s < chosen; s++) { /* the chosen positions that are codes (or the sink) */
        const int64_t a = spans[2 * s], z = spans[2 * s + 1] < coded - 1 ? spans[2 * s + 1] : coded - 1;
        if (a > z) break; /* ascending: the rest are float */
        spans[2 * n] = a;
        spans[2 * n + 1] = z;
        n++;
    }
    if (coded <= pos) { /* the float positions, all of them */
        if (n > 0 && spans[2 * n - 1] + 1 == coded)
            spans[2 * n - 1] = pos;
        else {
            spans[2 * n] = coded;
            spans[2 * n + 1] = pos;
            n++;
        }
    }
    return n;
}

/* q [Q, nh, d] float32 (not yet scaled: times q_scale, or 1/sqrt(d) where it is 0) -> out
 * [Q, nh, d] float32, each query seeing its last `window` positions (0: all). Sparse
 * attention: with `summary` (this layer's [rows, nkv, sblocks, 2, d] float32 block key
 * minimums and maximums, blocks of block_tokens positions) query i with topk[i] >= 0
 * attends to the blocks it selects by them (topk[i] besides those always kept) and to
 * every float position; topk[i] < 0 (or no summary) attends densely. Returns 0, or -1 on
 * a bad shape or an allocation failure. */
int edge_kv_attention(const float *q, int64_t nq, int64_t nh, const int64_t *rows, const int64_t *pos,
                      const int64_t *coded, const int64_t *frows, const int64_t *fbase, int64_t nkv, int64_t d,
                      int64_t code_len, int64_t kb, int64_t vg, int int4, const void *kcodes, const void *kscale,
                      const void *kzero, const void *vcodes, const void *vscale, const void *vzero, const float *kf,
                      const float *vf, int64_t falloc, int64_t fmod, const float *sk, const float *sv,
                      int64_t sink, int64_t window, float q_scale, const float *summary, int64_t sblocks,
                      int64_t block_tokens, const int64_t *topk, float *out, int threads) {
    if (nkv <= 0 || nh % nkv || d <= 0 || kb <= 0 || vg <= 0 || d % vg || (int4 && (d % 2 || vg % 2)) || fmod <= 0 ||
        window < 0 || code_len <= 0 || code_len % kb || (summary && (block_tokens <= 0 || sblocks <= 0 || !topk)))
        return -1;
    kv_layer L = {nkv,    d,      code_len, (code_len + kb - 1) / kb, d / vg, kb,      vg,          int4,
                  kcodes, vcodes, kscale,   kzero,                     vscale, vzero,   kf,          vf,
                  falloc, fmod,   sk,       sv,                        sink,   window,  summary,     sblocks,
                  block_tokens};
    const int group = (int)(nh / nkv);
    const float scale = q_scale > 0.0f ? q_scale : 1.0f / sqrtf((float)d);
    int64_t longest = 0;
    for (int64_t i = 0; i < nq; i++) {
        longest = pos[i] + 1 > longest ? pos[i] + 1 : longest;
        if (summary && topk[i] >= 0 && pos[i] / block_tokens >= sblocks) return -1; /* past the summaries */
    }
    const int64_t most_blocks = summary ? longest / block_tokens + 1 : 1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const size_t floats = (size_t)(group * longest + d * group + d + most_blocks);
        float *scores = malloc(sizeof(float) * floats);
        int64_t *spans = malloc(sizeof(int64_t) * (size_t)(2 * most_blocks + 2));
        unsigned char *keep = malloc((size_t)most_blocks);
        if (!scores || !spans || !keep) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float *qg = scores + group * longest;
            float *work = qg + d * group;
            float *bound = work + d;
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < nq * nkv; task++) {
                const int64_t i = task / nkv, h = task % nkv;
                const float *qi = q + (i * nh + h * group) * d;
                const int64_t nspans = attended(&L, qi, group, rows[i], h, pos[i], coded[i], summary ? topk[i] : -1,
                                                bound, keep, spans);
                for (int64_t c = 0; c < group * d; c++) qg[c] = qi[c] * scale;
                attend_one(&L, qg, group, rows[i], h, pos[i], coded[i], frows[i], fbase[i], spans, nspans,
                           out + (i * nh + h * group) * d, scores, work);
            }
        }
        free(scores);
        free(spans);
        free(keep);
    }
    return failed ? -1 : 0;
}

/* The spans a query attends to, as edge_kv_attention chooses them: q [group, d]
 * unscaled, summary one (row, KV head)'s [sblocks, 2, d], the token at `pos` with its
 * positions below `coded` codes; k < 0 dense. For the tests to hold against the float
 * step's selection. spans holds 2 * (pos / block_tokens + 2); returns how many, -2 out of
 * memory. */
int edge_kv_select(const float *q, int64_t group, int64_t d, const float *summary, int64_t pos, int64_t coded,
                   int64_t block_tokens, int64_t k, int64_t *spans) {
    const int64_t nb = pos / block_tokens + 1;
    kv_layer L;
    memset(&L, 0, sizeof L);
    L.nkv = 1;
    L.d = d;
    L.summary = summary;
    L.sblocks = nb;
    L.block_tokens = block_tokens;
    float *score = malloc(sizeof(float) * (size_t)nb);
    unsigned char *keep = malloc((size_t)nb);
    const int64_t n = score && keep ? attended(&L, q, (int)group, 0, 0, pos, coded, k, score, keep, spans) : -2;
    free(score);
    free(keep);
    return (int)n;
}
