// The quantized KV cache's kernels in CUDA C (edge/text/kv/quant_cache.py's layout), for
// boxes without Triton (a Jetson): the same work as edge/text/ops/triton/triton_kv.py.
//
// - A decode step's token into its row's float ring (rotated here in the fused step, with
//   the queries), and, on the step a key block leaves the window, that block coded from
//   the ring by one more block of threads a KV head in the same launch: the block's
//   tokens are older than the step's, so no other block of the launch writes them.
// - Attention split over the cache: each tile of 64 positions read from the codes (below
//   the row's coded length) or from the float ring (from there on), then merged as the
//   float cache's attention is (attention_common.cuh). Key scales (and int4 zero points)
//   are folded into the query once a tile; a value's scale multiplies its codes.
//
// Codes are computed as kv_quant.py computes them in torch (float32, IEEE division, halves
// rounded up, scales rounded to float16), so a cache coded here equals one coded there,
// code for code. Positions are read on the device, so a step captures into CUDA graphs.
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "attention_common.cuh"
#include "attention_mma.cuh"

namespace {

using namespace edge_cuda;

// The format (kv_quant.KVFormat) and the layer's sizes, as the entries receive them.
struct Format {
  int KB;        // tokens sharing a key scale per channel (a multiple of the 64-position tile)
  int VG;        // channels sharing a value scale
  int W;         // the window of newest tokens kept float
  int RING;      // ring slots; slot RING takes the row's last position's writes
  int SINK;      // the first tokens kept float for good
  int vsym;      // int4 values: codes 1..15 about 8, no zero point
  int code_len;  // code slots: position t's are slot t % code_len (a sliding layer's window, or every position)
  int blocks;    // key blocks the scales are allocated for
  int slide;     // attention: a sliding layer's window (each query sees its last `slide`
                 // positions, sink tokens only inside them), 0 for none; writes ignore it
};

// One layer's tensors, each [rows, NKV, ...]: the ring [.., RING + 1, HD] and the sink
// [.., SINK, HD] in the activations' type; codes [.., code_len, HD] int8 or [.., HD / 2]
// two int4 a byte (the even channel in the low nibble); key scales and zero points
// [.., blocks, HD] and value ones [.., code_len, HD / VG], float16.
template <typename C>
struct Layer {
  C* ring_k;
  C* ring_v;
  uint8_t* kc;
  __half* ks;
  __half* kz;
  uint8_t* vc;
  __half* vs;
  __half* vz;
  C* sink_k;
  C* sink_v;
};

__device__ __forceinline__ int ring_slot(long long pos, int max_len, const Format& f) {
  return pos == max_len - 1 ? f.RING : (int)(pos % f.RING);
}

// Whether the token at `pos` is the one with which a key block leaves the window (the
// block is pos - W - KB .. pos - W - 1): quant_cache's fmt.coded grows by KB there.
__device__ __forceinline__ bool block_due(long long pos, int max_len, const Format& f) {
  return pos != max_len - 1 && pos - f.W >= f.KB && (pos - f.W) % f.KB == 0;
}

// Round to the nearest integer, halves up, and clamp (kv_quant._round): no contraction.
__device__ __forceinline__ float code_of(float x, float safe, float lo, float hi) {
  return fminf(fmaxf(floorf(__fadd_rn(__fdiv_rn(x, safe), 0.5f)), lo), hi);
}

__device__ __forceinline__ float safe_scale(__half s) {
  const float f = __half2float(s);
  return f > 0.0f ? f : 1.0f;
}

// The keys of the block leaving the window with the token at `pos`, coded from the ring
// with scales per channel: a thread per channel pair. The sink tokens (read float) count
// as the first token after them, as kv_quant.without_sink has it.
template <typename C, bool INT4>
__device__ void code_keys(const Layer<C>& L, const Format& f, int head, long long pos, int HD) {
  const long long b0 = pos - f.W - f.KB;
  const C* ring = L.ring_k + (size_t)head * (f.RING + 1) * HD;
  const size_t at = ((size_t)head * f.blocks + (b0 / f.KB) % f.blocks) * HD;  // slot b % blocks
  const int cb = INT4 ? HD / 2 : HD;
  for (int p = threadIdx.x; p < HD / 2; p += blockDim.x) {
    float lo[2] = {INFINITY, INFINITY}, hi[2] = {-INFINITY, -INFINITY};
    for (int i = 0; i < f.KB; i++) {
      const long long t = max(b0 + i, (long long)f.SINK);
      const Pair<C> x = *reinterpret_cast<const Pair<C>*>(ring + (t % f.RING) * HD + 2 * p);
      lo[0] = fminf(lo[0], to_f(x.x));
      hi[0] = fmaxf(hi[0], to_f(x.x));
      lo[1] = fminf(lo[1], to_f(x.y));
      hi[1] = fmaxf(hi[1], to_f(x.y));
    }
    float low[2], safe[2];
#pragma unroll
    for (int c = 0; c < 2; c++) {
      __half scale;
      if (INT4) {
        const __half zero = __float2half_rn(lo[c]);
        low[c] = __half2float(zero);
        scale = __float2half_rn(__fdiv_rn(__fsub_rn(hi[c], low[c]), 15.0f));
        L.kz[at + 2 * p + c] = zero;
      } else {
        low[c] = 0.0f;
        scale = __float2half_rn(__fdiv_rn(fmaxf(fabsf(lo[c]), fabsf(hi[c])), 127.0f));
      }
      L.ks[at + 2 * p + c] = scale;
      safe[c] = safe_scale(scale);
    }
    for (int i = 0; i < f.KB; i++) {
      const long long t = max(b0 + i, (long long)f.SINK);
      const Pair<C> x = *reinterpret_cast<const Pair<C>*>(ring + (t % f.RING) * HD + 2 * p);
      uint8_t* dst = L.kc + ((size_t)head * f.code_len + b0 % f.code_len + i) * cb;  // a block never wraps
      if (INT4) {
        const int c0 = (int)code_of(__fsub_rn(to_f(x.x), low[0]), safe[0], 0.0f, 15.0f);
        const int c1 = (int)code_of(__fsub_rn(to_f(x.y), low[1]), safe[1], 0.0f, 15.0f);
        dst[p] = (uint8_t)(c0 | (c1 << 4));
      } else {
        dst[2 * p] = (uint8_t)(int8_t)code_of(to_f(x.x), safe[0], -127.0f, 127.0f);
        dst[2 * p + 1] = (uint8_t)(int8_t)code_of(to_f(x.y), safe[1], -127.0f, 127.0f);
      }
    }
  }
}

// The values of that block, with scales per token and group of VG channels: a warp per
// token, each lane HD / 32 neighbouring channels, a group's extremes reduced across its
// lanes (VG / (HD / 32) of them, a power of two).
template <typename C, bool INT4>
__device__ void code_values(const Layer<C>& L, const Format& f, int head, long long pos, int HD) {
  constexpr int MAX_CPL = 8;  // channels a lane holds, up to head_dim 256
  const long long b0 = pos - f.W - f.KB;
  const C* ring = L.ring_v + (size_t)head * (f.RING + 1) * HD;
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int cpl = HD / 32, lpg = f.VG / cpl, groups = HD / f.VG;
  for (int i = warp; i < f.KB; i += warps) {
    const long long t = b0 + i;
    const C* src = ring + (t % f.RING) * HD + lane * cpl;
    float x[MAX_CPL];
    float lo = INFINITY, hi = -INFINITY;
#pragma unroll
    for (int e = 0; e < MAX_CPL; e++) {
      if (e < cpl) {
        x[e] = to_f(src[e]);
        lo = fminf(lo, x[e]);
        hi = fmaxf(hi, x[e]);
      }
    }
    for (int o = lpg / 2; o > 0; o >>= 1) {
      lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
      hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    const size_t tok = (size_t)head * f.code_len + t % f.code_len;
    const size_t g_at = tok * groups + lane * cpl / f.VG;
    float low = 0.0f, qmin, qmax, shift = 0.0f;
    __half scale;
    if (INT4 && !f.vsym) {
      const __half zero = __float2half_rn(lo);
      low = __half2float(zero);
      scale = __float2half_rn(__fdiv_rn(__fsub_rn(hi, low), 15.0f));
      qmin = 0.0f;
      qmax = 15.0f;
      if (lane % lpg == 0) L.vz[g_at] = zero;
    } else {
      const float limit = INT4 ? 7.0f : 127.0f;
      scale = __float2half_rn(__fdiv_rn(fmaxf(fabsf(lo), fabsf(hi)), limit));
      qmin = -limit;
      qmax = limit;
      shift = INT4 ? 8.0f : 0.0f;
    }
    if (lane % lpg == 0) L.vs[g_at] = scale;
    const float safe = safe_scale(scale);
#pragma unroll
    for (int e = 0; e < MAX_CPL; e += 2) {
      if (e < cpl) {
        const float c0 = code_of(__fsub_rn(x[e], low), safe, qmin, qmax) + shift;
        const float c1 = code_of(__fsub_rn(x[e + 1], low), safe, qmin, qmax) + shift;
        if (INT4) {
          L.vc[tok * (HD / 2) + (lane * cpl + e) / 2] = (uint8_t)((int)c0 | ((int)c1 << 4));
        } else {
          L.vc[tok * HD + lane * cpl + e] = (uint8_t)(int8_t)c0;
          L.vc[tok * HD + lane * cpl + e + 1] = (uint8_t)(int8_t)c1;
        }
      }
    }
  }
}

template <typename C>
__device__ __forceinline__ void put(C* ring, C* sink, int head, long long pos, int slot, const Format& f, int HD,
                                    int d, float x) {
  ring[((size_t)head * (f.RING + 1) + slot) * HD + d] = from_f<C>(x);
  if (pos < f.SINK) sink[((size_t)head * f.SINK + pos) * HD + d] = from_f<C>(x);
}

template <typename C, bool INT4>
__device__ void code_block(const Layer<C>& L, const Format& f, int head, long long pos, int HD) {
  code_keys<C, INT4>(L, f, head, pos, HD);
  code_values<C, INT4>(L, f, head, pos, HD);
}

// The fused step's rotary for a quantized cache: block (b, head) of NH + 2 NKV + NKV. q
// rotated and pre-scaled into q [B, NH, HD]; k rotated and v written into the ring (and
// the sink) at pos[b]; the last NKV blocks code the block leaving the window, if one does.
template <typename Q, typename C, bool INT4>
__global__ void kv_rope_write_kernel(const Q* __restrict__ qkv, const float* __restrict__ cos,
                                     const float* __restrict__ sin, const long long* __restrict__ pos_ptr,
                                     C* __restrict__ q, Layer<C> L, Format f, int NH, int NKV, int max_len,
                                     float q_scale, int HD) {
  const int b = blockIdx.x, head = blockIdx.y, half = HD / 2;
  const long long pos = pos_ptr[b];
  if (head >= NH + 2 * NKV) {
    if (block_due(pos, max_len, f)) code_block<C, INT4>(L, f, b * NKV + head - NH - 2 * NKV, pos, HD);
    return;
  }
  const int slot = ring_slot(pos, max_len, f);
  const Q* row = qkv + ((size_t)b * (NH + 2 * NKV) + head) * HD;
  for (int r = threadIdx.x; r < half; r += blockDim.x) {
    float o1, o2;
    if (head < NH + NKV) {
      rotate(row, cos, sin, pos, HD, r, &o1, &o2);
    } else {
      o1 = to_f(row[r]);
      o2 = to_f(row[r + half]);
    }
    if (head < NH) {
      C* dst = q + ((size_t)b * NH + head) * HD;
      dst[r] = from_f<C>(o1 * q_scale);
      dst[r + half] = from_f<C>(o2 * q_scale);
    } else {
      const bool is_k = head < NH + NKV;
      const int kv = b * NKV + (is_k ? head - NH : head - NH - NKV);
      C* ring = is_k ? L.ring_k : L.ring_v;
      C* sink = is_k ? L.sink_k : L.sink_v;
      put(ring, sink, kv, pos, slot, f, HD, r, o1);
      put(ring, sink, kv, pos, slot, f, HD, r + half, o2);
    }
  }
}

// The op-by-op step's write: k, v [B, NKV, HD] (rotated) of one token per row at pos[b];
// block (b, h) of 2 NKV + NKV, the last NKV coding.
template <typename K, typename C, bool INT4>
__global__ void kv_write_kernel(const K* __restrict__ k, const K* __restrict__ v, const long long* __restrict__ pos_ptr,
                                Layer<C> L, Format f, int NKV, int max_len, int HD) {
  const int b = blockIdx.x, h = blockIdx.y;
  const long long pos = pos_ptr[b];
  if (h >= 2 * NKV) {
    if (block_due(pos, max_len, f)) code_block<C, INT4>(L, f, b * NKV + h - 2 * NKV, pos, HD);
    return;
  }
  const bool is_k = h < NKV;
  const int kv = b * NKV + (is_k ? h : h - NKV);
  const K* src = (is_k ? k : v) + (size_t)kv * HD;
  const int slot = ring_slot(pos, max_len, f);
  for (int d = threadIdx.x; d < HD; d += blockDim.x)
    put(is_k ? L.ring_k : L.ring_v, is_k ? L.sink_k : L.sink_v, kv, pos, slot, f, HD, d, to_f(src[d]));
}

// ---- attention -----------------------------------------------------------------------
constexpr int KV_THREADS = 128;
constexpr int KV_TILE = 64;  // positions a pass; a key block is whole tiles
constexpr int LANES = 8;     // lanes sharing one key's dot products

// BYTES (4, 8 or a multiple of 16) from 16-byte-aligned rows into words.
template <int BYTES>
__device__ __forceinline__ void load_words(const void* src, uint32_t* out) {
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; i++) {
      const uint4 w = reinterpret_cast<const uint4*>(src)[i];
      out[4 * i] = w.x;
      out[4 * i + 1] = w.y;
      out[4 * i + 2] = w.z;
      out[4 * i + 3] = w.w;
    }
  } else if constexpr (BYTES == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(src);
    out[0] = w.x;
    out[1] = w.y;
  } else {
    static_assert(BYTES == 4, "4, 8 or 16n bytes");
    out[0] = *reinterpret_cast<const uint32_t*>(src);
  }
}

// A lane's EPL neighbouring channels of one key, as floats: from the activations' type,
// int8 codes, or int4 codes (the even channel in the low nibble).
template <typename C, int EPL>
__device__ __forceinline__ void float_key(const C* src, float* out) {
  uint32_t w[EPL * sizeof(C) / 4];
  load_words<EPL * sizeof(C)>(src, w);
  const C* vals = reinterpret_cast<const C*>(w);
#pragma unroll
  for (int e = 0; e < EPL; e++) out[e] = to_f(vals[e]);
}

template <bool INT4, int EPL>
__device__ __forceinline__ void coded_key(const uint8_t* src, float* out) {
  constexpr int BYTES = INT4 ? EPL / 2 : EPL;
  uint32_t w[BYTES / 4];
  load_words<BYTES>(src, w);
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w);
#pragma unroll
  for (int j = 0; j < BYTES; j++) {
    if (INT4) {
      out[2 * j] = (float)(bytes[j] & 15);
      out[2 * j + 1] = (float)(bytes[j] >> 4);
    } else {
      out[j] = (float)(int8_t)bytes[j];
    }
  }
}

// The GROUP query heads of KV head kh of query qi against one chunk of the cache: the
// float cache's split kernel (decode_ops.cu) over codes and a ring. Decode (pos given):
// query qi is row qi's token at pos[qi], coded up to kv_quant's coded(pos + 1), its float
// tokens in the row's ring (slot t % RING). Chunk (pos null): query qi is position
// start_in + qi of row 0, coded up to coded_in, its float tokens from coded_in on in kf,
// vf [1, NKV, falloc, HD] (slot t - coded_in). Partial sums to acc and (m, l) to ml.
template <typename C, int HD, int GP, bool INT4>
__global__ void __launch_bounds__(KV_THREADS)
    kv_attn_split_kernel(const C* __restrict__ q, Layer<C> L, Format f, const C* __restrict__ kf,
                         const C* __restrict__ vf, const long long* __restrict__ pos_ptr, float* __restrict__ acc,
                         float* __restrict__ ml, int* __restrict__ done, C* __restrict__ out, int start_in,
                         int coded_in, float q_scale, int NH, int NKV, int falloc, int fmod, int chunk, int splits,
                         int group) {
  constexpr int EPL = HD / LANES;  // channels a lane takes in the scores
  constexpr int CB = INT4 ? HD / 2 : HD;
  constexpr int PAIRS = HD / 2;
  constexpr int TP = KV_THREADS / PAIRS;
  constexpr int WARPS = KV_THREADS / 32;
  constexpr int KEYS_PER_PASS = 32 / LANES;
  constexpr int VPRE = KV_TILE / TP < 16 ? KV_TILE / TP : 16;  // values a thread loads at once
  static_assert(EPL % 8 == 0 && TP >= 1, "head_dim 64 or 128");
  // Queries with channel li * EPL + e at e * LANES + li: a key's 8 lanes read 8 neighbouring words.
  __shared__ float qs[GP][HD];  // the queries, scaled
  __shared__ float qk[GP][HD];  // times the tile's key scales
  __shared__ float qz[GP];      // the queries . the tile's key zero points (int4)
  __shared__ float ps[GP][KV_TILE];
  __shared__ float m_s[GP], l_s[GP], alpha_s[GP];
  __shared__ float red[TP > 1 ? TP - 1 : 1][GP][HD];

  const int bh = blockIdx.x, sp = blockIdx.y;
  const int qi = bh / NKV, kh = bh % NKV;
  long long pos, coded, fbase;
  int row;
  if (pos_ptr != nullptr) {
    pos = pos_ptr[qi];
    row = qi;
    coded = max(pos - f.W, 0LL) / f.KB * f.KB;
    fbase = 0;
  } else {
    pos = start_in + qi;
    row = 0;
    coded = coded_in;
    fbase = coded_in;
  }
  const int head = row * NKV + kh;
  const long long end = min((long long)sp * chunk + chunk, pos + 1);
  // A sliding layer's first visible position; tiles wholly before it skipped (the first
  // one read holds it, so a tile never has every score masked).
  const long long lo = f.slide > 0 ? max(pos + 1 - f.slide, 0LL) : 0LL;
  const long long start = max((long long)sp * chunk, lo / KV_TILE * KV_TILE);
  const long long below = max(min(end, coded), start);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int li = lane % LANES, lg = lane / LANES;
  const int groups = HD / f.VG;

  load_queries<GP, HD, KV_THREADS>(q + ((size_t)qi * NH + kh * group) * HD, qs, group, q_scale,
                                   [](int d) { return (d % EPL) * LANES + d / EPL; });
  if (tid < GP) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  const int dp = tid % PAIRS, tp = tid / PAIRS;
  float a0[GP], a1[GP];
#pragma unroll
  for (int g = 0; g < GP; g++) a0[g] = a1[g] = 0.0f;
  const size_t codes_at = (size_t)head * f.code_len;
  const C* kf_row = kf + ((size_t)row * NKV + kh) * falloc * HD;
  const C* vf_row = vf + ((size_t)row * NKV + kh) * falloc * HD;
  __syncthreads();

  for (long long t0 = start; t0 < end; t0 += KV_TILE) {
    const int n = (int)min((long long)KV_TILE, end - t0);
    const bool is_coded = t0 < below;  // a tile lies wholly below or above the coded length
    // A position's value pair as loaded (float pair, or codes with their scale and zero
    // point), raw: loaded before the scores, which they do not depend on, their trip to
    // memory overlaps the keys'; decoded after the softmax.
    auto raw = [&](int tt, uint32_t& w, uint32_t& sw) {
      const long long t = t0 + tt;
      if (!is_coded || t < f.SINK) {
        const C* src =
            !is_coded ? vf_row + (size_t)((t - fbase) % fmod) * HD : L.sink_v + ((size_t)head * f.SINK + t) * HD;
        w = *reinterpret_cast<const uint32_t*>(src + 2 * dp);
        sw = 0u;  // float: no scale
        return;
      }
      const size_t tok = codes_at + t % f.code_len;
      const size_t g_at = tok * groups + 2 * dp / f.VG;
      w = INT4 ? (uint32_t)L.vc[tok * (HD / 2) + dp] : (uint32_t)*reinterpret_cast<const uint16_t*>(L.vc + tok * HD + 2 * dp);
      const uint32_t zero = INT4 && !f.vsym ? (uint32_t)__half_as_ushort(L.vz[g_at]) : 0u;
      sw = (uint32_t)__half_as_ushort(L.vs[g_at]) | (zero << 16);
    };
    auto fetch = [&](int k0, uint32_t* w, uint32_t* sw) {
#pragma unroll
      for (int k = 0; k < VPRE; k++) {
        const int tt = tp + (k0 + k) * TP;
        if (tt < n) raw(tt, w[k], sw[k]);
      }
    };
    auto accumulate_from = [&](int k0, const uint32_t* w, const uint32_t* sw) {
#pragma unroll
      for (int k = 0; k < VPRE; k++) {
        const int tt = tp + (k0 + k) * TP;
        if (tt >= n) break;
        float x, y;
        if (!is_coded || t0 + tt < f.SINK) {
          const Pair<C> pair = *reinterpret_cast<const Pair<C>*>(&w[k]);
          x = to_f(pair.x);
          y = to_f(pair.y);
        } else {
          const float scale = __half2float(__ushort_as_half((unsigned short)(sw[k] & 0xffffu)));
          const float zero = __half2float(__ushort_as_half((unsigned short)(sw[k] >> 16)));
          float c0, c1;
          if (INT4) {
            const float shift = f.vsym ? 8.0f : 0.0f;
            c0 = (float)(w[k] & 15u) - shift;
            c1 = (float)((w[k] >> 4) & 15u) - shift;
          } else {
            c0 = (float)(int8_t)(w[k] & 0xffu);
            c1 = (float)(int8_t)((w[k] >> 8) & 0xffu);
          }
          x = c0 * scale + zero;
          y = c1 * scale + zero;
        }
#pragma unroll
        for (int g = 0; g < GP; g++) {
          if (g >= group) break;
          const float p = ps[g][tt];
          a0[g] += p * x;
          a1[g] += p * y;
        }
      }
    };
    uint32_t vw[VPRE], vs_w[VPRE];
    fetch(0, vw, vs_w);
    if (is_coded) {
      // The tile's key scales (and zero points) folded into the queries.
      const size_t s_at = ((size_t)head * f.blocks + (t0 / f.KB) % f.blocks) * HD;
      for (int i = tid; i < group * HD; i += KV_THREADS) {
        const int g = i / HD, d = i % HD;
        const int at = (d % EPL) * LANES + d / EPL;
        qk[g][at] = qs[g][at] * __half2float(L.ks[s_at + d]);
      }
      if (INT4) {
        for (int g = warp; g < group; g += WARPS) {
          float s = 0.0f;
          for (int d = lane; d < HD; d += 32) s += qs[g][(d % EPL) * LANES + d / EPL] * __half2float(L.kz[s_at + d]);
          s = warp_sum(s);
          if (lane == 0) qz[g] = s;
        }
      }
      __syncthreads();
    }
    // Scores: warp w takes positions w*16 .. w*16+15, four at a time.
#pragma unroll(HD <= 128 ? 4 : 1)
    for (int j = 0; j < KV_TILE / (WARPS * KEYS_PER_PASS); j++) {
      const int tt = warp * (KV_TILE / WARPS) + j * KEYS_PER_PASS + lg;
      const long long t = t0 + tt;
      float kv[EPL];
      bool scaled = false;  // the codes' scales are in qk (and zero points in qz)
      if (tt >= n) {
#pragma unroll
        for (int e = 0; e < EPL; e++) kv[e] = 0.0f;
      } else if (!is_coded) {
        float_key<C, EPL>(kf_row + (size_t)((t - fbase) % fmod) * HD + li * EPL, kv);
      } else if (t < f.SINK) {  // the first tokens: float, in place of their codes
        float_key<C, EPL>(L.sink_k + ((size_t)head * f.SINK + t) * HD + li * EPL, kv);
      } else {
        coded_key<INT4, EPL>(L.kc + (codes_at + t % f.code_len) * CB + li * (INT4 ? EPL / 2 : EPL), kv);
        scaled = true;
      }
      const float(*qrow)[HD] = scaled ? qk : qs;
#pragma unroll
      for (int g = 0; g < GP; g++) {
        if (g >= group) break;
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; e++) s += kv[e] * qrow[g][e * LANES + li];
        for (int o = LANES / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (INT4 && scaled) s += qz[g];
        if (li == 0) ps[g][tt] = tt < n && t >= lo ? s : -INFINITY;
      }
    }
    __syncthreads();
    softmax_tile<WARPS>(ps, m_s, l_s, alpha_s, group, warp, lane);
    __syncthreads();
#pragma unroll
    for (int g = 0; g < GP; g++) {
      if (g >= group) break;
      a0[g] *= alpha_s[g];
      a1[g] *= alpha_s[g];
    }
    // Values: each thread two channels, its positions tp, tp + TP, ... in batches of VPRE,
    // the first batch loaded before the scores (see fetch).
    for (int k0 = 0; k0 * TP < n; k0 += VPRE) {
      if (k0 > 0) fetch(k0, vw, vs_w);
      accumulate_from(k0, vw, vs_w);
    }
    __syncthreads();
  }
  store_split<GP, HD, TP>(a0, a1, red, m_s, l_s, group, tp, dp, ((size_t)bh * splits + sp) * GP, acc, ml);
  merge_if_last<GP, HD, KV_THREADS>(done, bh, splits, group, acc, ml, out + ((size_t)qi * NH + kh * group) * HD);
}

// ---- attention on tensor cores -------------------------------------------------------
// kv_attn_split_kernel's work on attention_mma.cuh's layout (mma.sync m16n8k16), for up to
// 8 query rows a KV head and value groups of at least CPR = HD / 8 channels (a lane's
// channels of a value share one scale). A coded tile's codes are turned into the
// activations' type in registers (int8 and int4 codes are exact in float16 and bfloat16):
// the tile's key scales multiplied into the queries, the int4 key zero points' dot product
// with the queries added to each score, a value's scale (and zero point) applied as its
// codes are turned. The sink tokens of the first tile are float keys among codes: their
// scores come from a second product against the queries without the scales.

// Channels 2k and 2k + 1 of a lane's codes `w` (int8: a byte each; int4: the low and the
// high nibble of byte k), as floats. A code is put under the mantissa of 2^23 and 2^23 taken
// away (exact: the codes are small integers), where an integer-to-float conversion runs
// at a quarter of the float rate.
template <bool INT4>
__device__ __forceinline__ void code_pair(const uint32_t* w, int k, float& x, float& y) {
  constexpr uint32_t TWO23 = 0x4B000000u;  // 2^23 as float bits
  if constexpr (INT4) {
    const uint32_t byte = (w[k / 4] >> (8 * (k % 4))) & 0xffu;
    x = __uint_as_float(TWO23 | (byte & 15u)) - 8388608.0f;
    y = __uint_as_float(TWO23 | (byte >> 4)) - 8388608.0f;
  } else {
    // int8 codes offset by 128 (the sign bit flipped) to be placed, and 2^23 + 128 taken away.
    const uint32_t flipped = w[k / 2] ^ 0x80808080u, at = 16 * (k % 2);
    x = __uint_as_float(TWO23 | ((flipped >> at) & 0xffu)) - 8388736.0f;
    y = __uint_as_float(TWO23 | ((flipped >> (at + 8)) & 0xffu)) - 8388736.0f;
  }
}

// The same two channels as one word of two float16 values (pack2's order), less `shift`:
// the codes put under the mantissa of 1024 by byte permutes and 1024 (plus int8's offset
// of 128, plus shift) taken away in one float16 subtraction, exact. Two integer
// instructions and one float16 one for two channels, where the float route takes two
// quarter-rate conversions and a packing one.
template <bool INT4>
__device__ __forceinline__ __half2 code_pair_h2(const uint32_t* w, int k, uint32_t shift) {
  uint32_t bits;
  if constexpr (INT4) {
    const uint32_t word4 = w[k / 4], b = k % 4;
    const uint32_t lo = word4 & 0x0F0F0F0Fu, hi = (word4 >> 4) & 0x0F0F0F0Fu;
    bits = (__byte_perm(lo, hi, b | ((4 + b) << 8)) & 0x00FF00FFu) | 0x64006400u;
  } else {
    const uint32_t b = 2 * (k % 2);  // bytes b and b + 1 of word k / 2, each under 0x64
    bits = __byte_perm(w[k / 2] ^ 0x80808080u, 0x64646464u, b | 0x40u | ((b + 1) << 8) | 0x4000u);
  }
  // 1024 + offset as float16 bits (steps of 1 there), made as bits: a conversion of a
  // constant would not be folded.
  const uint32_t offset = 0x6400u + (INT4 ? 0u : 128u) + shift;
  const uint32_t offsets = offset | (offset << 16);
  __half2 h, o;
  memcpy(&h, &bits, sizeof h);
  memcpy(&o, &offsets, sizeof o);
  return __hsub2(h, o);
}

__device__ __forceinline__ uint32_t h2_bits(__half2 h) {
  uint32_t bits;
  memcpy(&bits, &h, sizeof bits);
  return bits;
}

// A lane's codes of a coded tile as loaded (attention_mma.cuh's layout): its keys' (r, r +
// 8) channels 32j + 8c .. +7 (CW words a group), its values' (2c, 2c + 1, 2c + 8, 2c + 9)
// CPR channels, the tile's key scales (and int4 zero points) of its key channels and its
// values' scales (and zero points). Codes are turned into the activations' type only
// where a product takes them, so a tile's turned keys and values are never all held at
// once: the kernel fits four blocks an SM (128 registers) without spilling.
template <int HD, bool INT4>
struct TileCodes {
  static constexpr int KW = HD / 32, CW = INT4 ? 1 : 2, VCW = HD / 8 / (INT4 ? 2 : 1) / 4;
  uint32_t k[2][KW][CW];
  uint32_t v[4][VCW];
  uint4 ks[KW], kz[KW];
  float vs[4], vz[4];
};

// Row r's queries at a lane's channels of one 8-channel group (qrow, from shared memory),
// times the key scales ks where SCALED (coded keys), as the scores' B fragment words: the
// value rounded to the activations' type (hi) and, where TWO, what that rounding left
// (lo). With both parts a score is as exact as float32 queries against the keys (the codes
// are exact): int4 zero points make products with the queries that cancel much of the
// codes', and a rounding of each large product would stay in the scores. Adds the queries'
// dot product with the int4 key zero points kz to zsum.
template <typename C, bool INT4, bool SCALED, bool TWO>
__device__ __forceinline__ void query_words(const float* qrow, const uint4& ks, const uint4& kz, float& zsum,
                                            uint32_t (&hi)[4], uint32_t (&lo)[4]) {
  const float4 q0 = reinterpret_cast<const float4*>(qrow)[0], q1 = reinterpret_cast<const float4*>(qrow)[1];
  const float qv[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
  const __half* s = reinterpret_cast<const __half*>(&ks);
  const __half* z = reinterpret_cast<const __half*>(&kz);
#pragma unroll
  for (int w = 0; w < 4; w++) {
    float x = qv[2 * w], y = qv[2 * w + 1];
    if constexpr (SCALED) {
      if constexpr (INT4) zsum += x * __half2float(z[2 * w]) + y * __half2float(z[2 * w + 1]);
      x *= __half2float(s[2 * w]);
      y *= __half2float(s[2 * w + 1]);
    }
    hi[w] = pack2<C>(x, y);
    if constexpr (TWO) {  // one packing conversion back and forth, not two
      const float2 h = unpack2<C>(hi[w]);
      lo[w] = pack2<C>(x - h.x, y - h.y);
    }
  }
}

// Key pair w (of 4) of a lane's 8-channel group `codes`, turned into the activations' type.
template <typename C, bool INT4>
__device__ __forceinline__ uint32_t key_word(const uint32_t* codes, int w) {
  if constexpr (std::is_same_v<C, __half>) {
    return h2_bits(code_pair_h2<INT4>(codes, w, 0u));
  } else {
    float x, y;
    code_pair<INT4>(codes, w, x, y);
    return pack2<C>(x, y);
  }
}

template <typename C, int HD, int GP, bool INT4>
__global__ void __launch_bounds__(KV_THREADS, 4)
    kv_attn_mma_kernel(const C* __restrict__ q, Layer<C> L, Format f, const C* __restrict__ kf,
                       const C* __restrict__ vf, const long long* __restrict__ pos_ptr, float* __restrict__ acc,
                       float* __restrict__ ml, int* __restrict__ done, C* __restrict__ out, int start_in,
                       int coded_in, float q_scale, int NH, int NKV, int falloc, int fmod, int chunk, int splits,
                       int group) {
  static_assert(HD == 64 || HD == 128, "head_dim 64 or 128");
  static_assert(GP <= MMA_ROWS, "up to 8 query rows a KV head");
  constexpr int WARPS = KV_THREADS / 32;
  constexpr int KW = HD / 32;             // a lane's 8-channel groups of a key
  constexpr int CPR = HD / 8;             // a lane's channels of a value
  constexpr int VW = CPR / 8;             // ... as 16-byte words of the activations' type
  constexpr int CB = INT4 ? HD / 2 : HD;  // code bytes a token
  constexpr int PER_BYTE = INT4 ? 2 : 1;  // channels a code byte
  // Scores in two parts (query_words) on codes where int4 zero points make large products
  // that cancel, and always for bfloat16, whose 8-bit mantissa would round the queries
  // (times the query scale, and the key scales) too coarsely; one part elsewhere (float16:
  // int8 codes and float keys, rounded as the float cache's kernel rounds its queries).
  constexpr bool BF16 = !std::is_same_v<C, __half>;
  constexpr bool TWO_CODED = BF16 || INT4;
  static_assert(KV_TILE / WARPS == MMA_WPOS, "16 positions a warp");
  using Codes = TileCodes<HD, INT4>;
  __shared__ __align__(16) C ps[WARPS][MMA_ROWS][MMA_WPOS + 8];
  __shared__ __align__(16) float qs[MMA_ROWS][HD];  // the queries times q_scale (zeros past the group)

  const int bh = blockIdx.x, sp = blockIdx.y;
  const int qi = bh / NKV, kh = bh % NKV;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, c = lane & 3;
  // Positions fit an int: a cache holds fewer than 2^31. The position's load is issued
  // first; what does not depend on it is worked out while it travels.
  const bool decode = pos_ptr != nullptr;
  const long long pos_in = decode ? pos_ptr[qi] : 0;
  const int row = decode ? qi : 0;
  const int head = row * NKV + kh;
  const int split_at = sp * chunk;
  const int fbase = decode ? 0 : coded_in;  // float token t in slot (t - fbase) % fmod
  const int groups = HD / f.VG;
  const int vgroup = CPR * r / f.VG;  // the value group of this lane's channels
  const size_t codes_at = (size_t)head * f.code_len;
  const C* kf_row = kf + ((size_t)row * NKV + kh) * falloc * HD;
  const C* vf_row = vf + ((size_t)row * NKV + kh) * falloc * HD;
  const float* qrow = qs[r] + 8 * c;  // row r's channels 32j + 8c .. +7 at qrow + 32j

  const auto load_codes = [&](int t0) {
    Codes cd;
    // The warp's slots: t % code_len (a sliding layer's codes are a circle of whole key
    // blocks, quant_cache.py; a 64-position tile lies in one block, so it never wraps).
    const int p0 = t0 % f.code_len + warp * MMA_WPOS;
#pragma unroll
    for (int u = 0; u < 2; u++) {
      const uint8_t* codes = L.kc + (codes_at + p0 + r + 8 * u) * CB;
#pragma unroll
      for (int j = 0; j < KW; j++) load_words<INT4 ? 4 : 8>(codes + (32 * j + 8 * c) / PER_BYTE, cd.k[u][j]);
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const size_t tok = codes_at + p0 + 2 * c + (u & 1) + 8 * (u >> 1);
      load_words<CPR / PER_BYTE>(L.vc + tok * CB + CPR * r / PER_BYTE, cd.v[u]);
      cd.vs[u] = __half2float(L.vs[tok * groups + vgroup]);
      cd.vz[u] = INT4 && !f.vsym ? __half2float(L.vz[tok * groups + vgroup]) : 0.0f;
    }
    const size_t s_at = ((size_t)head * f.blocks + (t0 / f.KB) % f.blocks) * HD;
#pragma unroll
    for (int j = 0; j < KW; j++) {
      cd.ks[j] = reinterpret_cast<const uint4*>(L.ks + s_at + 32 * j + 8 * c)[0];
      cd.kz[j] = INT4 ? reinterpret_cast<const uint4*>(L.kz + s_at + 32 * j + 8 * c)[0] : make_uint4(0, 0, 0, 0);
    }
    return cd;
  };
  // Scores S^T += K Q^T of float keys: a lane's words of keys r and r + 8 (krow(u), null
  // for none: zeros) against the unscaled queries.
  const auto float_scores = [&](float (&s)[4], const auto& krow) {
#pragma unroll
    for (int j = 0; j < KW; j++) {
      uint32_t a[2][4], hi[4], lo[4];
#pragma unroll
      for (int u = 0; u < 2; u++) {
        const C* src = krow(u);
        const uint4 w = src != nullptr ? reinterpret_cast<const uint4*>(src + 32 * j + 8 * c)[0] : make_uint4(0, 0, 0, 0);
        a[u][0] = w.x, a[u][1] = w.y, a[u][2] = w.z, a[u][3] = w.w;
      }
      float zsum = 0.0f;
      query_words<C, INT4, false, BF16>(qrow + 32 * j, make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0), zsum, hi, lo);
      mma_scores_step<C>(s, a[0], a[1], hi);
      if constexpr (BF16) mma_scores_step<C>(s, a[0], a[1], lo);
    }
  };
  // A value's words from a float row (zeros for none).
  const auto float_values = [&](uint4 (&vw)[VW], const C* src) {
#pragma unroll
    for (int j = 0; j < VW; j++) vw[j] = src != nullptr ? reinterpret_cast<const uint4*>(src + CPR * r)[j] : make_uint4(0, 0, 0, 0);
  };
  MmaState<HD / 16> st;

  // A coded tile (whole: below the coded length, so below `end` too). Keys turned a group
  // at a time as the product takes them, against the queries times the tile's key scales;
  // values turned after the scores, each with its scale (and zero point). The sink tokens
  // of the first tile are float keys among codes: their scores come from a second product
  // against the queries without the scales, their values from the sink.
  const auto coded_tile = [&](int t0, const Codes& cd, int first) {
    const int p0 = t0 + warp * MMA_WPOS;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float zsum = 0.0f;
#pragma unroll
    for (int j = 0; j < KW; j++) {
      uint32_t a[2][4], hi[4], lo[4];
#pragma unroll
      for (int u = 0; u < 2; u++) {
#pragma unroll
        for (int w = 0; w < 4; w++) a[u][w] = key_word<C, INT4>(cd.k[u][j], w);
      }
      query_words<C, INT4, true, TWO_CODED>(qrow + 32 * j, cd.ks[j], cd.kz[j], zsum, hi, lo);
      mma_scores_step<C>(s, a[0], a[1], hi);
      if constexpr (TWO_CODED) mma_scores_step<C>(s, a[0], a[1], lo);
    }
    const bool sink0 = p0 + r < f.SINK, sink1 = p0 + r + 8 < f.SINK;
    if constexpr (INT4) {  // rows 2c, 2c + 1: the queries . the key zero points, summed over a row's lanes
      zsum += __shfl_xor_sync(0xffffffffu, zsum, 1);
      zsum += __shfl_xor_sync(0xffffffffu, zsum, 2);
      const float qz0 = __shfl_sync(0xffffffffu, zsum, 8 * c), qz1 = __shfl_sync(0xffffffffu, zsum, 8 * c + 4);
      if (!sink0) s[0] += qz0, s[1] += qz1;
      if (!sink1) s[2] += qz0, s[3] += qz1;
    }
    const C* sink_k = L.sink_k + (size_t)head * f.SINK * HD;
    const C* sink_v = L.sink_v + (size_t)head * f.SINK * HD;
    if (p0 < f.SINK) {  // (warp-uniform) float keys among the codes
      float s2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      float_scores(s2, [&](int u) {
        const int t = p0 + r + 8 * u;
        return t < f.SINK ? sink_k + (size_t)t * HD : nullptr;
      });
      if (sink0) s[0] = s2[0], s[1] = s2[1];
      if (sink1) s[2] = s2[2], s[3] = s2[3];
    }
    uint4 vw[4][VW];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int t = p0 + 2 * c + (u & 1) + 8 * (u >> 1);
      if (t < f.SINK) {
        float_values(vw[u], sink_v + (size_t)t * HD);
      } else if constexpr (std::is_same_v<C, __half>) {
        // One rounding of the exact code * scale + zero (the float route rounds twice,
        // one float16 step apart at most where an int4 zero point is far from the product).
        const __half2 scale = __float2half2_rn(cd.vs[u]), zero = __float2half2_rn(cd.vz[u]);
        const uint32_t shift = INT4 && f.vsym ? 8u : 0u;
#pragma unroll
        for (int w = 0; w < CPR / 2; w++)
          set_word(vw[u][w / 4], w % 4, h2_bits(__hfma2(code_pair_h2<INT4>(cd.v[u], w, shift), scale, zero)));
      } else {
        const float shift = INT4 && f.vsym ? 8.0f : 0.0f;
#pragma unroll
        for (int w = 0; w < CPR / 2; w++) {
          float x, y;
          code_pair<INT4>(cd.v[u], w, x, y);
          set_word(vw[u][w / 4], w % 4, pack2<C>((x - shift) * cd.vs[u] + cd.vz[u], (y - shift) * cd.vs[u] + cd.vz[u]));
        }
      }
    }
    mma_tile_values<C, HD>(s, p0 + r >= first, p0 + r + 8 >= first, vw, ps[warp], st, r, c);
  };
  // A float tile: the ring's (decode) or the chunk's float tokens; zeros past the sequence.
  const auto float_tile = [&](int t0, int end, int first) {
    const int p0 = t0 + warp * MMA_WPOS;
    if (p0 >= end) return;  // the warp's positions all past the sequence's (warp-uniform)
    const auto slot = [&](int t) { return (size_t)((t - fbase) % fmod) * HD; };
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float_scores(s, [&](int u) {
      const int t = p0 + r + 8 * u;
      return t < end ? kf_row + slot(t) : nullptr;
    });
    uint4 vw[4][VW];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int t = p0 + 2 * c + (u & 1) + 8 * (u >> 1);
      float_values(vw[u], t < end ? vf_row + slot(t) : nullptr);
    }
    mma_tile_values<C, HD>(s, p0 + r < end && p0 + r >= first, p0 + r + 8 < end && p0 + r + 8 >= first, vw, ps[warp],
                           st, r, c);
  };

  // A decode block's first tile is coded unless it lies among the last tokens (the window
  // and the key block being filled): its codes are loaded before the position arrives, and
  // the queries after them (load_queries waits for its loads to store them), so the three
  // trips to memory overlap as the float kernel's do. (Not in a sliding layer, whose first
  // tile the position moves.)
  const bool early = decode && f.slide == 0 && split_at + KV_TILE <= f.code_len && split_at / f.KB < f.blocks;
  Codes first_codes;
  if (early) first_codes = load_codes(split_at);
  load_queries<MMA_ROWS, HD, KV_THREADS>(q + ((size_t)qi * NH + kh * group) * HD, qs, group, q_scale,
                                         [](int d) { return d; });
  const int pos = decode ? (int)pos_in : start_in + qi;
  const int coded = decode ? max(pos - f.W, 0) / f.KB * f.KB : coded_in;
  const int end = min(split_at + chunk, pos + 1);
  // A sliding layer's first visible position; tiles wholly before it skipped (the first
  // one read holds it, so a tile never has every score masked).
  const int first = f.slide > 0 ? max(pos + 1 - f.slide, 0) : 0;
  const int start = max(split_at, first / KV_TILE * KV_TILE);
  const int below = max(min(end, coded), start);
  const bool first_coded = start < below;  // a tile lies wholly below or above the coded length
  if (!early && first_coded && start < end) first_codes = load_codes(start);
  __syncthreads();  // the queries in shared memory

  if (start < end) {  // the first tile apart: its codes may be loaded already
    if (first_coded) coded_tile(start, first_codes, first);
    else float_tile(start, end, first);
  }
  for (int t0 = start + KV_TILE; t0 < end; t0 += KV_TILE) {
    if (t0 < below) coded_tile(t0, load_codes(t0), first);
    else float_tile(t0, end, first);
  }
  mma_finish<C, GP, HD, KV_THREADS>(st, group, bh, sp, splits, acc, ml, done,
                                    out + ((size_t)qi * NH + kh * group) * HD);
}

template <typename C>
Layer<C> layer_of(const void* const* t) {
  return Layer<C>{static_cast<C*>(const_cast<void*>(t[0])),       static_cast<C*>(const_cast<void*>(t[1])),
                  static_cast<uint8_t*>(const_cast<void*>(t[2])), static_cast<__half*>(const_cast<void*>(t[3])),
                  static_cast<__half*>(const_cast<void*>(t[4])),  static_cast<uint8_t*>(const_cast<void*>(t[5])),
                  static_cast<__half*>(const_cast<void*>(t[6])),  static_cast<__half*>(const_cast<void*>(t[7])),
                  static_cast<C*>(const_cast<void*>(t[8])),       static_cast<C*>(const_cast<void*>(t[9]))};
}

Format format_of(const int* v) { return Format{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8]}; }

// Threads of a write block: the rotary's HD / 2 and the coder's warps at once.
int write_threads(int HD) { return max(128, HD / 2); }

bool format_ok(const Format& f, int HD) {
  const int cpl = HD / 32;
  return (HD == 64 || HD == 128) && f.KB % KV_TILE == 0 && f.VG >= cpl && f.VG % cpl == 0 &&
         HD % f.VG == 0 && ((f.VG / cpl) & (f.VG / cpl - 1)) == 0 && f.VG / cpl <= 32;
}

template <typename C, int HD, bool INT4>
cudaError_t split_for(int gp, dim3 grid, cudaStream_t s, const C* q, const Layer<C>& L, const Format& f, const C* kf,
                      const C* vf, const long long* pos, float* acc, float* ml, int* done, C* out, int start_in, int coded_in,
                      float q_scale, int NH, int NKV, int falloc, int fmod, int chunk, int splits) {
  const int group = NH / NKV;
#define EDGE_KV_SPLIT(GPV)                                                                                          \
  kv_attn_split_kernel<C, HD, GPV, INT4><<<grid, KV_THREADS, 0, s>>>(q, L, f, kf, vf, pos, acc, ml, done, out, start_in,     \
                                                                     coded_in, q_scale, NH, NKV, falloc, fmod,    \
                                                                     chunk, splits, group)
#define EDGE_KV_MMA(GPV)                                                                                            \
  kv_attn_mma_kernel<C, HD, GPV, INT4><<<grid, KV_THREADS, 0, s>>>(q, L, f, kf, vf, pos, acc, ml, done, out, start_in,       \
                                                                   coded_in, q_scale, NH, NKV, falloc, fmod, chunk,     \
                                                                   splits, group)
  // The tensor cores where a lane's channels of a value share a scale (mma_ok); else scalar.
  const bool mma = f.VG >= HD / 8;
  if (gp == 4 && mma) EDGE_KV_MMA(4);
  else if (gp == 8 && mma) EDGE_KV_MMA(8);
  else if (gp == 4) EDGE_KV_SPLIT(4);
  else if (gp == 8) EDGE_KV_SPLIT(8);
  else if (gp == 16) EDGE_KV_SPLIT(16);
  else return cudaErrorInvalidValue;
#undef EDGE_KV_SPLIT
#undef EDGE_KV_MMA
  return cudaGetLastError();
}

template <typename C, bool INT4>
cudaError_t split_hd(int HD, int gp, dim3 grid, cudaStream_t s, const C* q, const Layer<C>& L, const Format& f,
                     const C* kf, const C* vf, const long long* pos, float* acc, float* ml, int* done, C* out, int start_in,
                     int coded_in, float q_scale, int NH, int NKV, int falloc, int fmod, int chunk, int splits) {
  if (HD == 64)
    return split_for<C, 64, INT4>(gp, grid, s, q, L, f, kf, vf, pos, acc, ml, done, out, start_in, coded_in, q_scale, NH, NKV,
                                  falloc, fmod, chunk, splits);
  if (HD == 128)
    return split_for<C, 128, INT4>(gp, grid, s, q, L, f, kf, vf, pos, acc, ml, done, out, start_in, coded_in, q_scale, NH, NKV,
                                   falloc, fmod, chunk, splits);
  return cudaErrorInvalidValue;
}

// Calls f with a null pointer of the float cache type a dtype code names (no float32:
// the attention's loads are built for 16-bit activations), and INT4 as a type.
template <typename F>
cudaError_t with_cache(int dtype, int int4, F f) {
  if (dtype == 2) return cudaErrorInvalidValue;
  return with_type(dtype, [&](auto* c) {
    if constexpr (std::is_same_v<std::remove_pointer_t<decltype(c)>, float>) {
      return cudaErrorInvalidValue;
    } else {
      return int4 ? f(c, std::true_type{}) : f(c, std::false_type{});
    }
  });
}

}  // namespace

extern "C" {

// Every entry returns a cudaError_t (0: launched). `tensors` holds the layer's ten
// pointers (ring_k, ring_v, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, sink_k,
// sink_v; a tensor a format lacks stands in with another, never read); `format` its nine
// ints (key block, value group, window, ring, sink, values symmetric, code_len, blocks,
// and the attention's sliding window, 0 for none).
// dtype codes: 0 bfloat16, 1 float16 (the cache's activations; float32 is refused).

int edge_kv_rope_write(const void* qkv, int qkv_dtype, const float* cos, const float* sin, const long long* pos,
                       void* q, const void* const* tensors, const int* format, int cache_dtype, int int4, int B,
                       int NH, int NKV, int max_len, float q_scale, int HD, void* stream) {
  const Format f = format_of(format);
  if (!format_ok(f, HD)) return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return int(with_type(qkv_dtype, [&](auto* qt) {
    using Q = std::remove_pointer_t<decltype(qt)>;
    return with_cache(cache_dtype, int4, [&](auto* ct, auto is4) {
      using C = std::remove_pointer_t<decltype(ct)>;
      kv_rope_write_kernel<Q, C, decltype(is4)::value><<<dim3(B, NH + 3 * NKV), write_threads(HD), 0, s>>>(
          static_cast<const Q*>(qkv), cos, sin, pos, static_cast<C*>(q), layer_of<C>(tensors), f, NH, NKV, max_len,
          q_scale, HD);
      return cudaGetLastError();
    });
  }));
}

int edge_kv_write(const void* k, const void* v, int in_dtype, const long long* pos, const void* const* tensors,
                  const int* format, int cache_dtype, int int4, int B, int NKV, int max_len, int HD, void* stream) {
  const Format f = format_of(format);
  if (!format_ok(f, HD)) return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return int(with_type(in_dtype, [&](auto* kt) {
    using K = std::remove_pointer_t<decltype(kt)>;
    return with_cache(cache_dtype, int4, [&](auto* ct, auto is4) {
      using C = std::remove_pointer_t<decltype(ct)>;
      kv_write_kernel<K, C, decltype(is4)::value><<<dim3(B, 3 * NKV), write_threads(HD), 0, s>>>(
          static_cast<const K*>(k), static_cast<const K*>(v), pos, layer_of<C>(tensors), f, NKV, max_len, HD);
      return cudaGetLastError();
    });
  }));
}

// q [nq, NH, HD] against the cache -> out [nq, NH, HD] in the cache's type. Decode: pos
// [nq] (row i's token at pos[i], float tokens in the ring: kf, vf the ring, falloc RING
// + 1, fmod RING); chunk: pos null, query i at start_in + i of row 0, coded up to
// coded_in, float tokens in kf, vf [1, NKV, falloc, HD] from coded_in on (fmod falloc).
// acc [nq * NKV * splits * gp, HD] and ml [.., 2] float32 scratch; done [nq * NKV] int32
// zeros, left zeros (see merge_if_last); chunk a multiple of 64.
int edge_kv_attention(const void* q, const void* const* tensors, const int* format, const void* kf, const void* vf,
                      const long long* pos, float* acc, float* ml, int* done, void* out, int dtype, int int4, int nq, int NH,
                      int NKV, int falloc, int fmod, int start_in, int coded_in, float q_scale, int HD, int gp,
                      int chunk, int splits, void* stream) {
  const Format f = format_of(format);
  if (!format_ok(f, HD) || NH % NKV != 0 || NH / NKV > gp || chunk < 1 || chunk % KV_TILE != 0 || splits < 1 ||
      splits > MAX_SPLITS)
    return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return int(with_cache(dtype, int4, [&](auto* ct, auto is4) {
    using C = std::remove_pointer_t<decltype(ct)>;
    constexpr bool INT4 = decltype(is4)::value;
    return split_hd<C, INT4>(HD, gp, dim3(nq * NKV, splits), s, static_cast<const C*>(q), layer_of<C>(tensors), f,
                             static_cast<const C*>(kf), static_cast<const C*>(vf), pos, acc, ml, done,
                             static_cast<C*>(out), start_in, coded_in, q_scale, NH, NKV, falloc, fmod, chunk, splits);
  }));
}

}  // extern "C"
