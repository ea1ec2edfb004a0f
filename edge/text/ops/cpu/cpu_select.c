/* Sparse attention's block selection (Quest: Tang et al., 2024), shared by the CPU's
 * decode step over a float cache (cpu_step.c) and the quantized cache's attention
 * (cpu_kv.c), which both include this file: one rule, the same ties and the same blocks
 * always kept, so both choose the same blocks given the same summaries and queries.
 * Plain C (no intrinsics): built with either kernel on x86_64 and aarch64 alike. */
#ifndef EDGE_CPU_SELECT_C
#define EDGE_CPU_SELECT_C

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The spans of positions 0..last a token attends to in a layer that sees every position:
 * block 0, the last two blocks (its own and the one before) and the k others whose bound
 * on the group's scores is highest (Quest's: the most any query head of the group can
 * score against a key within the block's per-channel min and max, sum over channels of
 * max(q min, q max)), ties to the lower block; merged into spans in position order.
 * summary: this (layer, row, KV head)'s blocks; score [blocks] and keep [blocks] scratch;
 * spans [2 * blocks]. Returns how many spans. */
static int64_t select_spans(const float *q, int group, int64_t d, const float *summary, int64_t last,
                            int64_t block_tokens, int64_t k, float *score, unsigned char *keep, int64_t *spans) {
    const int64_t nb = last / block_tokens + 1;
    memset(keep, 0, (size_t)nb);
    keep[0] = keep[nb - 1] = 1;
    if (nb > 1) keep[nb - 2] = 1;
    const int64_t candidates = nb > 3 ? nb - 3 : 0; /* blocks 1..nb - 3 */
    if (candidates <= k) {
        for (int64_t b = 1; b + 2 < nb; b++) keep[b] = 1;
    } else if (k > 0) {
        for (int64_t b = 1; b + 2 < nb; b++) {
            const float *lo = summary + b * 2 * d, *hi = lo + d;
            float best = -INFINITY;
            for (int g = 0; g < group; g++) {
                const float *qg = q + g * d;
                float bound = 0.0f;
                for (int64_t c = 0; c < d; c++) {
                    const float a = qg[c] * lo[c], z = qg[c] * hi[c];
                    bound += a > z ? a : z;
                }
                if (bound > best) best = bound;
            }
            score[b] = best;
        }
        for (int64_t pick = 0; pick < k; pick++) {
            int64_t top = -1;
            for (int64_t b = 1; b + 2 < nb; b++)
                if (!keep[b] && (top < 0 || score[b] > score[top])) top = b;
            keep[top] = 1;
        }
    }
    int64_t n = 0;
    for (int64_t b = 0; b < nb; b++) {
        if (!keep[b]) continue;
        const int64_t first = b * block_tokens, end = b + 1 == nb ? last : first + block_tokens - 1;
        if (n > 0 && spans[2 * n - 1] + 1 == first)
            spans[2 * n - 1] = end; /* adjoins the span before */
        else {
            spans[2 * n] = first;
            spans[2 * n + 1] = end;
            n++;
        }
    }
    return n;
}

#endif /* EDGE_CPU_SELECT_C */
