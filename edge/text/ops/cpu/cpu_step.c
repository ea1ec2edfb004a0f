/* One decode step of an INT4 Llama on the CPU, every layer in one call.
 *
 * Op by op in torch a CPU decode step is about 180 operators per layer, each a Python
 * call, a dispatch and a small allocation: on SmolLM2-135M at two threads that overhead
 * was a third of the step. Here each layer is, in float32 throughout:
 *
 *    RMSNorm -> qkv product -> (q/k head norms) -> rotary + KV-cache write ->
 *    attention over the row's positions (its window's, in a sliding layer) -> o product
 *    (-> RMSNorm) + residual -> RMSNorm -> gate/up product -> SiLU (or GELU) * up -> down
 *    product (-> RMSNorm) + residual
 *
 * and the caller does the embedding before and the final norm and head after (one
 * operator each). The INT4 products are cpu_int4.c's, included here (float32, or with
 * int8 activations where the matrix says so), so the weights are the quantized model's
 * own to the last bit and each output is summed in the same order whatever the batch. Attention sums each (row, head) in a fixed order too: a
 * sequence's logits do not depend on the sequences decoded beside it. A product is one
 * weight (q, k and v fused, as the loader fuses them) or its parts side by side (q, k
 * and v apart); a GGUF Q8_0 weight, kept as two INT4 halves, is multiplied as both and
 * its halves added after in float32, as the per-op layer adds them.
 *
 * Llama's graph, with what the families built on it add where a layer has it: Qwen3's
 * q/k head norms, a sliding window (Mistral, Phi-3, Gemma 3's local layers) with its own
 * rotary table (Gemma 3's), Gemma 3's GELU and the norms of each branch's output, and
 * Phi-4-mini's partial rotary (the leading `rotary` channels of a head turned). Gemma 3's
 * attention scale is the model's `scale`; its scaled embedding and logit cap are the
 * caller's, before and after the call. No biases: the runtime (edge/text/runtime/cpu_step.py) refuses anything else by
 * name and runs the step op by op instead. Built on the box like cpu_int4.c and called through ctypes.
 *
 * Sparse attention (Quest: Tang et al., 2024), where the cache keeps block summaries: a layer that sees every
 * position keeps, per row, KV head and block of block_tokens positions, the per-channel min and max of its keys.
 * A token at or past min_context attends only to block 0 (the first tokens), its own block and the one before
 * (the recent window) and the top_k others whose summaries bound its group's scores highest, in position order;
 * a sliding layer stays dense. The summaries are brought up to date here, lazily: a row's `summarized` count
 * says over how many of its first positions they are exact; every write below it (the token after drafts
 * turned down, written over them; a torch write, which the runtime reports: KVCache.rewritten) lowers it to
 * the written block's start, and a step that selects makes them exact up to the positions it writes before it
 * selects. A write the step does not see lowers the count: it never leaves a summary read stale.
 */
#include <math.h>

#include "cpu_int4.c"
#include "cpu_select.c"

typedef struct {
    const uint8_t *q;      /* [n, k / 2] two codes a byte, even k in the low nibble */
    const float *scales;   /* [n, k / group] */
    const uint8_t *zeros;  /* [n, k / group] */
    int64_t n, k, group;   /* n: the tensors' rows (with halves, twice the outputs) */
    int64_t int8;          /* nonzero: its activations rounded to int8 (edge_int4_linear_int8) */
    const float *minimums; /* [n, k / group] added to each weight of a group (a GGUF Q4_1
                              block's minimum), or NULL */
    int64_t halves;        /* nonzero: rows [0, n / 2) and [n / 2, n) are two weights, high
                              and low, whose sum is this one (a GGUF Q8_0 weight kept as two
                              INT4 halves): output j is row j's plus row n / 2 + j's */
} int4_matrix;

#define MAX_PARTS 3

/* One of a layer's products: its parts' outputs side by side in one output row, part p's
 * from the column where part p - 1's end. One part where the loader fused the weights;
 * q, k and v (or the gate and the up) apart where it kept them so (weights in halves,
 * group sizes that differ). */
typedef struct {
    int64_t parts;
    int4_matrix part[MAX_PARTS];
} int4_product;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    int4_product qkv, o, gate_up, down;  /* qkv: q's outputs, k's, v's; gate_up: the gate's,
                                            then the up's */
    const float *q_norm, *k_norm;        /* [head_dim]: each q and k head's RMSNorm before the
                                            rotary (Qwen3), or NULL */
    int64_t window;                      /* a sliding layer's: each token sees its last
                                            `window` positions; 0: every earlier one */
    const float *cos, *sin;              /* this layer's rotary tables, or NULL: the model's */
    const float *attn_out_norm, *mlp_out_norm; /* [hidden]: each branch's output normalised
                                                  before its add (Gemma 3), or NULL */
    int64_t gelu;                        /* nonzero: GELU (tanh form) * up, not SiLU * up */
} step_layer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;        /* RMSNorm epsilon; attention's scale on the scores */
    const float *cos, *sin;  /* [positions, rotary] */
    int64_t positions;
    int64_t rotary;          /* the leading channels of a head the rotary turns (Phi-4-mini: 3/4) */
} step_model;

typedef struct {
    float *k, *v;                              /* the layers that hold every position:
                                                  [layers, rows, kv_heads, slots, head_dim] */
    int64_t layer_stride, row_stride, slots;   /* in floats; slots per row */
    int64_t rows;
    float *local_k, *local_v;                  /* the sliding layers' own buffers (float_cache.py):
                                                  [layers, rows, kv_heads, local_slots, head_dim],
                                                  or NULL */
    int64_t local_layer_stride, local_row_stride, local_slots;
    const int64_t *offsets;                    /* [rows]: the position a row's slot 0 holds there */
    const int64_t *index;                      /* [layers]: a layer's index in k/v, or -1 - its
                                                  index in local_k/local_v */
    float *summary;                            /* sparse attention's block summaries: [summarized layers,
                                                  rows, kv_heads, blocks, 2 (min, max), head_dim], or
                                                  NULL (dense, nothing kept) */
    int64_t summary_layer_stride, summary_row_stride, blocks, block_tokens;
    const int64_t *summary_index;              /* [layers]: a layer's index in summary, or -1 (a
                                                  sliding layer: dense, no summaries) */
    int64_t *summarized;                       /* [rows]: the summaries are exact over a row's positions
                                                  below this (block b over b * block_tokens up to it) */
    int64_t top_k, min_context;                /* top_k > 0: a token at min_context or later attends
                                                  to its top_k blocks besides those always kept */
} step_cache;

/* Where layer i keeps its keys and values, and token b's slot there: its position, or in a
 * sliding layer's own buffer the position less the row's offset (the buffer's last slot
 * for a row not advanced, which sits at the cache's last position). */
typedef struct {
    float *k, *v;
    int64_t row_stride, slots;
    int local;
} layer_cache;

static layer_cache cache_of(const step_cache *C, int64_t i) {
    const int64_t ix = C->index[i];
    if (ix >= 0) {
        const layer_cache at = {C->k + ix * C->layer_stride, C->v + ix * C->layer_stride, C->row_stride, C->slots, 0};
        return at;
    }
    const int64_t j = -1 - ix;
    const layer_cache at = {C->local_k + j * C->local_layer_stride, C->local_v + j * C->local_layer_stride,
                            C->local_row_stride, C->local_slots, 1};
    return at;
}

static int64_t slot_of(const step_cache *C, const layer_cache *at, int64_t row, int64_t pos) {
    if (!at->local) return pos;
    return pos == C->slots - 1 ? at->slots - 1 : pos - C->offsets[row];
}

/* out = x / rms(x) * w (out may be x): the mean of squares in a fixed pairwise order. */
static void rmsnorm(const float *x, const float *w, int64_t n, float eps, float *out) {
    vfloat acc = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vfloat v = load_floats(x + i);
        acc += v * v;
    }
    float sum = sum_lanes(acc);
    for (; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t j = 0; j < n; j++) out[j] = x[j] * inv * w[j];
}

/* Each of `rows` vectors of n floats normalised in place by w; nothing where w is NULL (a
 * norm the layer does not have). */
static void rmsnorm_rows(float *x, const float *w, int64_t rows, int64_t n, float eps) {
    if (!w) return;
    for (int64_t r = 0; r < rows; r++) rmsnorm(x + r * n, w, n, eps, x + r * n);
}

/* Rotary in place on a head's leading d channels: x * cos + rotate_half(x) * sin, as apply_rope. */
static void rope(float *x, const float *cos, const float *sin, int64_t d) {
    const int64_t half = d / 2;
    float tmp[512];
    for (int64_t j = 0; j < half; j++) {
        tmp[j] = x[j] * cos[j] - x[j + half] * sin[j];
        tmp[j + half] = x[j + half] * cos[j + half] + x[j] * sin[j + half];
    }
    memcpy(x, tmp, sizeof(float) * (size_t)d);
}

/* GELU in its tanh form, as torch's gelu(approximate="tanh"). */
static inline float gelu_tanh(float x) {
    const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x); /* sqrt(2 / pi) */
    return 0.5f * x * (1.0f + tanhf(inner));
}

static inline float dot(const float *a, const float *b, int64_t d) {
    vfloat acc = {0};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES) acc += load_floats(a + i) * load_floats(b + i);
    float sum = sum_lanes(acc);
    for (; i < d; i++) sum += a[i] * b[i];  /* a head size not a multiple of LANES (Qwen3's small ones) */
    return sum;
}

/* The `group` query heads of KV head h of batch row b against the positions of `spans`
 * (first..last pairs, ascending, nspans of them): out [group, d]. scores holds as many
 * floats as the last position + 1. Dense attention is one span; the sums run over the
 * positions in order either way, so a sparse step that keeps every block is dense's to
 * the bit. */
static void attend(const step_model *M, const float *q, const float *keys, const float *values, const int64_t *spans,
                   int64_t nspans, int group, float *out, float *scores) {
    const int64_t d = M->head_dim;
    for (int g = 0; g < group; g++) {
        const float *qg = q + g * d;
        float top = -INFINITY;
        for (int64_t s = 0; s < nspans; s++)
            for (int64_t t = spans[2 * s]; t <= spans[2 * s + 1]; t++) {
                scores[t] = dot(qg, keys + t * d, d) * M->scale;
                if (scores[t] > top) top = scores[t];
            }
        float total = 0.0f;
        for (int64_t s = 0; s < nspans; s++)
            for (int64_t t = spans[2 * s]; t <= spans[2 * s + 1]; t++) {
                scores[t] = expf(scores[t] - top);
                total += scores[t];
            }
        float *o = out + g * d;
        for (int64_t c = 0; c < d; c++) o[c] = 0.0f;
        for (int64_t s = 0; s < nspans; s++)
            for (int64_t t = spans[2 * s]; t <= spans[2 * s + 1]; t++) {
                const float p = scores[t] / total;
                const float *v = values + t * d;
                for (int64_t c = 0; c < d; c++) o[c] += p * v[c];
            }
    }
}

/* Make one (layer, row, KV head)'s block summaries [blocks, 2, d] exact over positions
 * below `to`, given them exact below `from`: a key at a block's first position resets
 * the block's min and max to it, a later one widens them. */
static void summarize(float *summary, const float *keys, int64_t from, int64_t to, int64_t block_tokens, int64_t d) {
    for (int64_t t = from; t < to; t++) {
        float *lo = summary + (t / block_tokens) * 2 * d, *hi = lo + d;
        const float *k = keys + t * d;
        if (t % block_tokens == 0) {
            memcpy(lo, k, sizeof(float) * (size_t)d);
            memcpy(hi, k, sizeof(float) * (size_t)d);
            continue;
        }
        for (int64_t c = 0; c < d; c++) {
            if (k[c] < lo[c]) lo[c] = k[c];
            if (k[c] > hi[c]) hi[c] = k[c];
        }
    }
}

/* The spans select_spans gives a token at `last` with query heads q [group, d] over one
 * (layer, row, KV head)'s summaries [blocks, 2, d]: for the tests to hold against a
 * reference. spans holds 2 * blocks; returns how many spans, -2 out of memory. */
int edge_cpu_step_select(const float *q, int64_t group, int64_t d, const float *summary, int64_t last,
                         int64_t block_tokens, int64_t k, int64_t *spans) {
    const int64_t nb = last / block_tokens + 1;
    float *score = malloc(sizeof(float) * (size_t)nb);
    unsigned char *keep = malloc((size_t)nb);
    const int64_t n = score && keep ? select_spans(q, (int)group, d, summary, last, block_tokens, k, score, keep, spans)
                                    : -2;
    free(score);
    free(keep);
    return (int)n;
}

/* y [m, n] = x [m, k] @ W.T over the tensors' n rows (a weight in halves not yet added);
 * a weight's block minimums added after the codes' product as the group sums of x times
 * the minimums (sum (q d + mn) x = d sum q x + mn sum x), as Int4Linear.forward adds them
 * (its sums in torch's order: equal to float32 rounding). */
static int matrix_product(const int4_matrix *W, const float *x, int64_t m, float *y, int threads) {
    const int rc = W->int8 ? edge_int4_linear_int8(x, m, W->k, W->q, W->scales, W->zeros, W->n, W->group, y, threads)
                           : edge_int4_linear(x, m, W->k, W->q, W->scales, W->zeros, W->n, W->group, y, threads);
    if (rc != 0 || !W->minimums) return rc;
    const int64_t G = W->k / W->group;
    float *sums = malloc(sizeof(float) * (size_t)(m * G));
    if (!sums) return -2;
    for (int64_t b = 0; b < m; b++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int64_t i = 0; i < W->group; i++) s += x[b * W->k + g * W->group + i];
            sums[b * G + g] = s;
        }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < W->n; j++)
        for (int64_t b = 0; b < m; b++) {
            float t = 0.0f;
            for (int64_t g = 0; g < G; g++) t += sums[b * G + g] * W->minimums[j * G + g];
            y[b * W->n + j] += t;
        }
    free(sums);
    return 0;
}

static int64_t outputs_of(const int4_matrix *W) { return W->halves ? W->n / 2 : W->n; }

static int64_t width_of(const int4_product *P) {
    int64_t width = 0;
    for (int64_t p = 0; p < P->parts; p++) width += outputs_of(P->part + p);
    return width;
}

/* Whether part W of P is made in a scratch buffer and then put in place: a weight in
 * halves (its two rows added), or one of several parts for more than one row (the
 * kernel writes a row's outputs contiguously, not at the product's row stride). One
 * part alone, the fused case, is written where it belongs with no copy. */
static int through_scratch(const int4_product *P, const int4_matrix *W, int64_t m) {
    return W->halves || (m > 1 && P->parts > 1);
}

/* The floats P's parts need of scratch for m rows. */
static int64_t scratch_of(const int4_product *P, int64_t m) {
    int64_t most = 0;
    for (int64_t p = 0; p < P->parts; p++)
        if (through_scratch(P, P->part + p, m) && m * P->part[p].n > most) most = m * P->part[p].n;
    return most;
}

/* Whether P takes inputs of k floats and gives `width` outputs: 0, else -1. */
static int check_product(const int4_product *P, int64_t k, int64_t width) {
    if (P->parts < 1 || P->parts > MAX_PARTS) return -1;
    for (int64_t p = 0; p < P->parts; p++) {
        const int4_matrix *W = P->part + p;
        if (W->k != k || W->n < 1 || (W->halves && W->n % 2 != 0)) return -1;
    }
    return width_of(P) == width ? 0 : -1;
}

/* y [m, width] = x [m, k] times each part's weight, part p's outputs at its column
 * offset; a weight in halves summed high + low in float32, as Int4Linear.forward adds
 * them, so each output is the per-op product's to the bit. scratch holds
 * scratch_of(P, m) floats. */
static int product(const int4_product *P, const float *x, int64_t m, float *y, float *scratch, int threads) {
    const int64_t width = width_of(P);
    int64_t at = 0;
    for (int64_t p = 0; p < P->parts; p++) {
        const int4_matrix *W = P->part + p;
        const int64_t n = outputs_of(W);
        if (!through_scratch(P, W, m)) { /* one row, or the only part: in place */
            const int rc = matrix_product(W, x, m, y + at, threads);
            if (rc != 0) return rc;
        } else {
            const int rc = matrix_product(W, x, m, scratch, threads);
            if (rc != 0) return rc;
            for (int64_t b = 0; b < m; b++) {
                const float *s = scratch + b * W->n;
                float *to = y + b * width + at;
                if (W->halves)
                    for (int64_t j = 0; j < n; j++) to[j] = s[j] + s[n + j]; /* high + low */
                else
                    memcpy(to, s, sizeof(float) * (size_t)n);
            }
        }
        at += n;
    }
    return 0;
}

/* One product as the decode step makes it, y [m, width of P] for x [m, k]: for the tests
 * to hold against Int4Linear. Returns 0; -1 for parts the step does not take, -2 out of
 * memory. */
int edge_cpu_step_product(const int4_product *P, const float *x, int64_t m, float *y, int threads) {
    if (P->parts < 1 || P->parts > MAX_PARTS || check_product(P, P->part[0].k, width_of(P)) != 0) return -1;
    const int64_t need = scratch_of(P, m);
    float *scratch = need ? malloc(sizeof(float) * (size_t)need) : NULL;
    if (need && !scratch) return -2;
    const int rc = product(P, x, m, y, scratch, threads);
    free(scratch);
    return rc;
}

/* Each (batch row, KV head)'s scratch for attention: scores over positions (`positions`
 * floats each), and sparse attention's block bounds, kept blocks and spans (`blocks`
 * each, spans twice that). */
typedef struct {
    float *scores;
    int64_t positions;
    float *bound;
    unsigned char *keep;
    int64_t *spans;
    int64_t blocks;
} attention_scratch;

/* The summaries sparse attention reads for layer i (NULL: it attends densely: no
 * summaries, or a sliding layer, which its window bounds already). */
static float *summary_of(const step_cache *C, const step_layer *L, int64_t i) {
    if (!C->summary || L->window > 0 || C->index[i] < 0 || C->summary_index[i] < 0) return NULL;
    return C->summary + C->summary_index[i] * C->summary_layer_stride;
}

/* Layer i's attention for the step's B tokens, the keys and values already written: the
 * group's query heads of batch row b's KV head j at q + b * q_stride + j * group * d,
 * out [B, heads * d]. Every position up to the token's (its window's in a sliding layer),
 * or its selected blocks where the cache keeps summaries and it selects (the header). */
static void attend_layer(const step_model *M, const step_layer *L, const step_cache *C, int64_t i, const float *q,
                         int64_t q_stride, int64_t B, const int64_t *rows, const int64_t *pos, int64_t kv_len,
                         float *out, const attention_scratch *work, int threads) {
    const int64_t d = M->head_dim, nh = M->heads, nkv = M->kv_heads;
    const int group = (int)(nh / nkv);
    const layer_cache at = cache_of(C, i);
    const int64_t at_len = kv_len < at.slots ? kv_len : at.slots;
    const float *summary = summary_of(C, L, i);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t w = 0; w < B * nkv; w++) {
        const int64_t b = w / nkv, j = w % nkv;
        const int64_t head = rows[b] * at.row_stride + j * at.slots * d;
        const int64_t slot = slot_of(C, &at, rows[b], pos[b]);
        const int64_t last = slot < at_len ? slot : at_len - 1;
        const int64_t first = L->window > 0 && last >= L->window ? last + 1 - L->window : 0;
        const float *qg = q + b * q_stride + j * group * d;
        int64_t *span = work->spans + w * 2 * work->blocks, nspans = 1;
        span[0] = first;
        span[1] = last;
        if (summary && C->top_k > 0 && (pos[b] >= kv_len || pos[b] >= C->min_context)) {
            /* A row not advanced keeps the blocks always kept and selects none. */
            const int64_t k = pos[b] >= kv_len ? 0 : C->top_k;
            nspans = select_spans(qg, group, d, summary + rows[b] * C->summary_row_stride + j * C->blocks * 2 * d, last,
                                  C->block_tokens, k, work->bound + w * work->blocks, work->keep + w * work->blocks,
                                  span);
        }
        attend(M, qg, at.k + head, at.v + head, span, nspans, group, out + (b * nh + j * group) * d,
               work->scores + w * work->positions);
    }
}

/* x [B, hidden]: the residual stream in (the tokens' embeddings), the last layer's out.
 * Row b of the batch is a token at position pos[b] of cache row rows[b], attending to
 * positions 0..min(pos[b], kv_len - 1) (in a sliding layer the last `window` of them, from
 * its own buffer where the cache gives it one) as the per-op step does (a row the batch does not
 * advance sits at the cache's last slot, at or past kv_len: its answer is not read, and it costs no more
 * than a real row's). Several batch rows may share a cache row at consecutive
 * positions (a sequence's token and its drafts, verified at once): each layer writes
 * every row's keys and values before any attends, so each attends causally.
 * With block summaries and top_k (the header's sparse attention), a token at min_context
 * or later attends to its selected blocks in the layers that see every position; a row
 * not advanced attends to the blocks always kept (it selects nothing and summarizes
 * nothing). Returns 0;
 * -1 for a head or product shape the kernel does not take, -2 out of memory, -3 a position past the
 * cache or the rotary table, or a cache row past the cache. */
int edge_cpu_decode_layers(const step_model *M, const step_layer *layers, const step_cache *C, float *x, int64_t B,
                           const int64_t *rows, const int64_t *pos, int64_t kv_len, int threads) {
    const int64_t H = M->hidden, d = M->head_dim, nh = M->heads, nkv = M->kv_heads;
    if (d % 2 != 0 || d > 512 || nh % nkv != 0 || M->rotary % 2 != 0 || M->rotary < 2 || M->rotary > d) return -1;
    if (kv_len < 1 || kv_len > C->slots) return -3;
    const int sparse = C->summary != NULL;
    if (sparse && (C->block_tokens < 1 || C->blocks * C->block_tokens < C->slots || C->top_k < 0)) return -1;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) {
        if (pos[b] < 0 || pos[b] >= C->slots || pos[b] >= M->positions) return -3;
        if (rows[b] < 0 || rows[b] >= C->rows) return -3;
        if (pos[b] > longest) longest = pos[b];
        /* In a sliding buffer a token's slot is below the last (the scratch), unless its
         * row is not advanced (at the cache's last position). */
        if (C->local_k && pos[b] != C->slots - 1) {
            const int64_t rel = pos[b] - C->offsets[rows[b]];
            if (rel < 0 || rel >= C->local_slots - 1) return -3;
        }
    }
    if (longest >= kv_len) longest = kv_len - 1;
    const int64_t qkv_n = (nh + 2 * nkv) * d, wide = 2 * M->intermediate;
    const int64_t widest = qkv_n > wide ? qkv_n : wide;
    int64_t spare = 0; /* the scratch the largest product needs (product()) */
    for (int64_t i = 0; i < M->layers; i++) {
        const step_layer *L = layers + i;
        if (check_product(&L->qkv, H, qkv_n) || check_product(&L->o, nh * d, H) ||
            check_product(&L->gate_up, H, wide) || check_product(&L->down, M->intermediate, H))
            return -1;
        const int4_product *all[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
        for (int p = 0; p < 4; p++)
            if (scratch_of(all[p], B) > spare) spare = scratch_of(all[p], B);
    }
    const int64_t most_blocks = sparse ? longest / C->block_tokens + 1 : 1;
    float *h = malloc(sizeof(float) * (size_t)(B * H));
    float *big = malloc(sizeof(float) * (size_t)(B * widest));
    float *attn = malloc(sizeof(float) * (size_t)(B * nh * d));
    float *act = malloc(sizeof(float) * (size_t)(B * M->intermediate));
    float *proj = malloc(sizeof(float) * (size_t)(B * H));
    float *scores = malloc(sizeof(float) * (size_t)(B * nkv * (longest + 1)));
    float *scratch = spare ? malloc(sizeof(float) * (size_t)spare) : NULL;
    /* Sparse attention's scratch: each (batch row, KV head)'s block bounds, kept blocks and
     * spans; each cache row's positions written (lo..hi - 1), where its summaries are
     * brought up to date from, and whether a token of it selects. */
    float *bound = malloc(sizeof(float) * (size_t)(B * nkv * most_blocks));
    unsigned char *keep = malloc((size_t)(B * nkv * most_blocks));
    int64_t *spans = malloc(sizeof(int64_t) * (size_t)(B * nkv * 2 * most_blocks));
    int64_t *lo = malloc(sizeof(int64_t) * (size_t)(3 * C->rows)), *hi = lo + C->rows, *from = hi + C->rows;
    unsigned char *selects = malloc((size_t)C->rows);
    int rc = (h && big && attn && act && proj && scores && (scratch || !spare) && bound && keep && spans && lo &&
              selects)
                 ? 0
                 : -2;
    const int tracked = rc == 0 && sparse; /* lo, hi, from and selects hold this call's rows */
    if (tracked) {
        for (int64_t r = 0; r < C->rows; r++) {
            lo[r] = -1;
            hi[r] = -1;
            selects[r] = 0;
        }
        for (int64_t b = 0; b < B; b++) {
            const int64_t r = rows[b];
            lo[r] = lo[r] < 0 || pos[b] < lo[r] ? pos[b] : lo[r];
            if (pos[b] >= kv_len) continue; /* not advanced: written, not summarized */
            hi[r] = pos[b] + 1 > hi[r] ? pos[b] + 1 : hi[r];
            if (C->top_k > 0 && pos[b] >= C->min_context) selects[r] = 1;
        }
        for (int64_t r = 0; r < C->rows; r++) {
            if (lo[r] < 0) continue;
            const int64_t mark = C->summarized[r];
            /* Appended to (or past) what is summarized: widened from there. Written below it
             * (a rollback's rewrite, a row not advanced): the block is summarized again from
             * its first position, the count back to that block's start until it is. */
            from[r] = lo[r] >= mark ? mark : lo[r] / C->block_tokens * C->block_tokens;
            if (lo[r] < mark) C->summarized[r] = from[r];
        }
    }
    for (int64_t i = 0; i < M->layers && rc == 0; i++) {
        const step_layer *L = layers + i;
        for (int64_t b = 0; b < B; b++) rmsnorm(x + b * H, L->input_norm, H, M->eps, h + b * H);
        if ((rc = product(&L->qkv, h, B, big, scratch, threads)) != 0) break;
        const layer_cache at = cache_of(C, i);
        for (int64_t b = 0; b < B; b++) {
            float *row = big + b * qkv_n;
            const int64_t rot = M->rotary;
            const float *cs = (L->cos ? L->cos : M->cos) + pos[b] * rot;
            const float *sn = (L->sin ? L->sin : M->sin) + pos[b] * rot;
            rmsnorm_rows(row, L->q_norm, nh, d, M->eps);
            rmsnorm_rows(row + nh * d, L->k_norm, nkv, d, M->eps);
            for (int64_t j = 0; j < nh + nkv; j++) rope(row + j * d, cs, sn, rot);
            for (int64_t j = 0; j < nkv; j++) {
                const int64_t to = rows[b] * at.row_stride + (j * at.slots + slot_of(C, &at, rows[b], pos[b])) * d;
                memcpy(at.k + to, row + (nh + j) * d, sizeof(float) * (size_t)d);
                memcpy(at.v + to, row + (nh + nkv + j) * d, sizeof(float) * (size_t)d);
            }
        }
        float *summary = summary_of(C, L, i);
        if (summary) {
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t w = 0; w < C->rows * nkv; w++) {
                const int64_t r = w / nkv, j = w % nkv;
                if (!selects[r]) continue;
                summarize(summary + r * C->summary_row_stride + j * C->blocks * 2 * d,
                          at.k + r * at.row_stride + j * at.slots * d, from[r], hi[r], C->block_tokens, d);
            }
        }
        const attention_scratch work = {scores, longest + 1, bound, keep, spans, most_blocks};
        attend_layer(M, L, C, i, big, qkv_n, B, rows, pos, kv_len, attn, &work, threads);
        if ((rc = product(&L->o, attn, B, proj, scratch, threads)) != 0) break;
        rmsnorm_rows(proj, L->attn_out_norm, B, H, M->eps);
        for (int64_t j = 0; j < B * H; j++) x[j] += proj[j];
        for (int64_t b = 0; b < B; b++) rmsnorm(x + b * H, L->post_norm, H, M->eps, h + b * H);
        if ((rc = product(&L->gate_up, h, B, big, scratch, threads)) != 0) break;
        const int64_t I = M->intermediate;
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < I; j++) {
                const float g = big[b * wide + j], u = big[b * wide + I + j];
                act[b * I + j] = (L->gelu ? gelu_tanh(g) : g / (1.0f + expf(-g))) * u;
            }
        if ((rc = product(&L->down, act, B, proj, scratch, threads)) != 0) break;
        rmsnorm_rows(proj, L->mlp_out_norm, B, H, M->eps);
        for (int64_t j = 0; j < B * H; j++) x[j] += proj[j];
    }
    if (tracked)
        for (int64_t r = 0; r < C->rows; r++) {
            if (lo[r] < 0 || !selects[r]) continue;
            /* Every layer summarized its keys up to hi; a step failing part way left some
             * layers' block from[r] widened by keys it may write again: summarized afresh. */
            const int64_t start = from[r] / C->block_tokens * C->block_tokens;
            if (rc == 0)
                C->summarized[r] = hi[r];
            else if (start < C->summarized[r])
                C->summarized[r] = start;
        }
    free(h);
    free(big);
    free(attn);
    free(act);
    free(proj);
    free(scores);
    free(scratch);
    free(bound);
    free(keep);
    free(spans);
    free(lo);
    free(selects);
    return rc;
}

/* Every layer's attention alone, as the step runs it, over the cache as it stands
 * (nothing written, no summary brought up to date): q [layers, B, heads * d] the tokens'
 * query heads (turned by the rotary), out likewise. For the benchmarks to time attention
 * apart from the layers' products, in one call. Returns 0; -1 a head shape it does not
 * take, -2 out of memory, -3 a position or row past the cache. */
int edge_cpu_step_attention(const step_model *M, const step_layer *layers, const step_cache *C, const float *q,
                            int64_t B, const int64_t *rows, const int64_t *pos, int64_t kv_len, float *out,
                            int threads) {
    const int64_t d = M->head_dim, nkv = M->kv_heads, width = M->heads * d;
    if (M->heads % nkv != 0 || d > 512) return -1;
    if (kv_len < 1 || kv_len > C->slots) return -3;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) {
        if (pos[b] < 0 || pos[b] >= C->slots || rows[b] < 0 || rows[b] >= C->rows) return -3;
        if (C->local_k && pos[b] != C->slots - 1) {
            const int64_t rel = pos[b] - C->offsets[rows[b]];
            if (rel < 0 || rel >= C->local_slots - 1) return -3;
        }
        if (pos[b] > longest) longest = pos[b];
    }
    if (longest >= kv_len) longest = kv_len - 1;
    const int64_t most_blocks = C->summary ? longest / C->block_tokens + 1 : 1;
    float *scores = malloc(sizeof(float) * (size_t)(B * nkv * (longest + 1)));
    float *bound = malloc(sizeof(float) * (size_t)(B * nkv * most_blocks));
    unsigned char *keep = malloc((size_t)(B * nkv * most_blocks));
    int64_t *spans = malloc(sizeof(int64_t) * (size_t)(B * nkv * 2 * most_blocks));
    const int rc = scores && bound && keep && spans ? 0 : -2;
    if (rc == 0) {
        const attention_scratch work = {scores, longest + 1, bound, keep, spans, most_blocks};
        for (int64_t i = 0; i < M->layers; i++)
            attend_layer(M, layers + i, C, i, q + i * B * width, width, B, rows, pos, kv_len, out + i * B * width,
                         &work, threads);
    }
    free(scores);
    free(bound);
    free(keep);
    free(spans);
    return rc;
}
