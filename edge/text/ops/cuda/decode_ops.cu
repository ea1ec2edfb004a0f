// The decode step's kernels between the INT4 products, in CUDA C: residual add + RMSNorm,
// rotary + KV-cache write (decode and prefill), attention split over the cache and
// merged, SiLU * up. The same work as the Triton kernels (edge/text/ops/triton/
// decode_ops.py), for boxes without Triton (a Jetson): built on the box by nvcc and
// called through ctypes on torch's current stream, so CUDA graphs capture them.
//
// Every kernel reads the cache only up to each sequence's position, and positions are
// read on the device, so a step captures into one graph per KV-length bucket.
//
// Attention sums in float32 from the cache's float16 or bfloat16 values (no tensor
// cores: a decode step has at most 16 query rows per KV head, and the cache read is
// what costs). Splits and the chunk a split covers are the caller's (the same rule as
// the Triton kernels', chosen as for one sequence whatever the batch): a sequence's
// attention is summed in the same order alone or batched.
#include <stdint.h>

#include <type_traits>

#include "attention_common.cuh"
#include "attention_mma.cuh"

namespace {

using namespace edge_cuda;

// ---- residual add + RMSNorm --------------------------------------------------------
// x [B, H] float32 += delta (in place, where given); h = x * rsqrt(mean(x^2) + eps) * w.
// One block per row. A thread takes VEC neighbouring values per load (16 bytes of x
// where H allows it) and up to LOADS such loads, all issued before any value is used: at
// batch 1 a step runs this twice a layer and its latency is its whole cost, so the row
// is spread over as many threads (up to 1024) as it has vectors, each with a load or two
// in flight, rather than over few threads each walking many values (4.6 us a norm at
// hidden size 4096 on an H100 with 128 threads of 32 values; Triton's takes 2.3). The
// sum of squares in a fixed order (a row's norm the same alone or batched).
constexpr int NORM_THREADS = 1024;
constexpr int NORM_VALUES = 8;  // values a thread holds at most: hidden sizes to 8192

template <typename D, typename T, int VEC>
__global__ void __launch_bounds__(NORM_THREADS)
    add_rmsnorm_kernel(float* __restrict__ x, const D* __restrict__ delta, const T* __restrict__ w,
                       T* __restrict__ h, int H, float eps) {
  constexpr int LOADS = NORM_VALUES / VEC;
  __shared__ float sums[32];
  __shared__ float inv_s;
  const int row = blockIdx.x, n = blockDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* xr = x + (size_t)row * H;
  const D* dr = delta == nullptr ? nullptr : delta + (size_t)row * H;
  T* hr = h + (size_t)row * H;
  float v[NORM_VALUES], d[NORM_VALUES], wv[NORM_VALUES];
#pragma unroll
  for (int k = 0; k < LOADS; k++) {
    const int i = (threadIdx.x + k * n) * VEC;
#pragma unroll
    for (int e = 0; e < VEC; e++) v[k * VEC + e] = d[k * VEC + e] = wv[k * VEC + e] = 0.0f;
    if (i < H) {
      load_vec<float, VEC>(xr + i, v + k * VEC);
      if (dr != nullptr) load_vec<D, VEC>(dr + i, d + k * VEC);
      load_vec<T, VEC>(w + i, wv + k * VEC);
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < LOADS; k++) {
    const int i = (threadIdx.x + k * n) * VEC;
#pragma unroll
    for (int e = 0; e < VEC; e++) {
      v[k * VEC + e] += d[k * VEC + e];
      ss += v[k * VEC + e] * v[k * VEC + e];
    }
    if (dr != nullptr && i < H) store_vec<float, VEC>(xr + i, v + k * VEC);
  }
  ss = warp_sum(ss);
  if (lane == 0) sums[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    const float total = warp_sum(lane < (n >> 5) ? sums[lane] : 0.0f);
    if (lane == 0) inv_s = rsqrtf(total / (float)H + eps);
  }
  __syncthreads();
  const float inv = inv_s;
#pragma unroll
  for (int k = 0; k < LOADS; k++) {
    const int i = (threadIdx.x + k * n) * VEC;
    if (i < H) {
      float o[VEC];
#pragma unroll
      for (int e = 0; e < VEC; e++) o[e] = v[k * VEC + e] * inv * wv[k * VEC + e];
      store_vec<T, VEC>(hr + i, o);
    }
  }
}

// ---- rotary + cache write ------------------------------------------------------------
// Decode: block (b, head), HD/2 threads. q rotated and pre-scaled by q_scale into q [B, NH,
// HD]; k rotated into the cache [B, NKV, L, HD] at slot[b]; v copied there. The rotary
// turns the first `rot` channels of a head (tables [positions, rot]; rot = HD but for a
// partial rotary, whose other channels pass unturned) at position pos[b]; the slot is the
// position but in a sliding layer's own buffer (the position less the row's offset).
template <typename Q, typename C>
__global__ void rope_kv_kernel(const Q* __restrict__ qkv, const float* __restrict__ cos, const float* __restrict__ sin,
                               const long long* __restrict__ pos_ptr, const long long* __restrict__ slot_ptr,
                               C* __restrict__ q, C* __restrict__ kc, C* __restrict__ vc, int NH, int NKV, int max_len,
                               float q_scale, int HD, int rot) {
  const int b = blockIdx.x, head = blockIdx.y, r = threadIdx.x, half = HD / 2;
  const long long pos = pos_ptr[b], slot = slot_ptr[b];
  const Q* row = qkv + ((size_t)b * (NH + 2 * NKV) + head) * HD;
  if (head < NH + NKV) {
    C* dst;
    float scale = 1.0f;
    if (head < NH) {
      dst = q + ((size_t)b * NH + head) * HD;
      scale = q_scale;
    } else {
      dst = kc + (((size_t)b * NKV + head - NH) * max_len + slot) * HD;
    }
    if (r < rot / 2) {
      float o1, o2;
      rotate(row, cos, sin, pos, rot, r, &o1, &o2);
      if (head < NH) {
        o1 *= scale;
        o2 *= scale;
      }
      dst[r] = from_f<C>(o1);
      dst[r + rot / 2] = from_f<C>(o2);
    }
    for (int d = rot + r; d < HD; d += half) dst[d] = from_f<C>(to_f(row[d]) * scale);  // a partial rotary's rest
  } else {
    C* dst = vc + (((size_t)b * NKV + head - NH - NKV) * max_len + slot) * HD;
    dst[r] = from_f<C>(to_f(row[r]));
    dst[r + half] = from_f<C>(to_f(row[r + half]));
  }
}

// Prefill of a fresh prompt (positions 0..T-1): block (t, head). q into q [T, NH, HD]
// (pre-scaled); k rotated and v copied into k/v [NKV, T, HD] (what attention reads) and
// into the cache's row *row_ptr [rows, NKV, L, HD].
template <typename Q, typename C>
__global__ void rope_prefill_kernel(const Q* __restrict__ qkv, const float* __restrict__ cos,
                                    const float* __restrict__ sin, const long long* __restrict__ row_ptr,
                                    C* __restrict__ q, C* __restrict__ k, C* __restrict__ v, C* __restrict__ kc,
                                    C* __restrict__ vc, int T, int NH, int NKV, int max_len, float q_scale, int HD) {
  const int t = blockIdx.x, head = blockIdx.y, r = threadIdx.x, half = HD / 2;
  const long long crow = row_ptr[0];
  const Q* src = qkv + ((size_t)t * (NH + 2 * NKV) + head) * HD;
  float o1, o2;
  if (head < NH + NKV) {
    rotate(src, cos, sin, t, HD, r, &o1, &o2);
    if (head < NH) {
      C* dst = q + ((size_t)t * NH + head) * HD;
      dst[r] = from_f<C>(o1 * q_scale);
      dst[r + half] = from_f<C>(o2 * q_scale);
      return;
    }
  } else {
    o1 = to_f(src[r]);
    o2 = to_f(src[r + half]);
  }
  const bool is_k = head < NH + NKV;
  const int kv = is_k ? head - NH : head - NH - NKV;
  C* flat = (is_k ? k : v) + ((size_t)kv * T + t) * HD;
  C* cached = (is_k ? kc : vc) + (((size_t)crow * NKV + kv) * max_len + t) * HD;
  flat[r] = cached[r] = from_f<C>(o1);
  flat[r + half] = cached[r + half] = from_f<C>(o2);
}

// ---- attention -----------------------------------------------------------------------
constexpr int ATTN_THREADS = 128;
constexpr int ATTN_TILE = 64;      // cache positions per pass of a block
constexpr int LANES_PER_TOKEN = 8;  // lanes that share one key's dot products

// The GROUP query heads of KV head kh of sequence b against one chunk of the cache, by
// tiles of 64 positions with an online softmax. Scores: 8 lanes per key, each with
// HD/8 of its channels (16-byte loads), reduced by shuffles. Values: each thread owns
// two channels for every query row, over every (256/HD)-th position of the tile. The
// partial sums go to acc [(bh * splits + sp) * GP + g, HD] and (m, l) to ml; a chunk past
// the position reads nothing and leaves m = -inf, l = 0.
template <typename C, int HD, int GP>
__global__ void __launch_bounds__(ATTN_THREADS)
    attn_split_kernel(const C* __restrict__ q, const C* __restrict__ kc, const C* __restrict__ vc,
                      const long long* __restrict__ pos_ptr, float* __restrict__ acc, float* __restrict__ ml,
                      int* __restrict__ done, C* __restrict__ out, int NH, int NKV, int max_len, int chunk, int splits,
                      int group, int window) {
  constexpr int EPL = HD / LANES_PER_TOKEN;   // channels per lane in the scores
  constexpr int PAIRS = HD / 2;               // value channel pairs
  constexpr int TP = ATTN_THREADS / PAIRS;    // positions of a tile taken at once (values)
  constexpr int WARPS = ATTN_THREADS / 32;
  constexpr int KEYS_PER_PASS = 32 / LANES_PER_TOKEN;
  constexpr int VPRE = ATTN_TILE / TP < 32 ? ATTN_TILE / TP : 32;  // values a thread loads early
  static_assert(EPL % 8 == 0 && TP >= 1, "head_dim 64, 128 or 256");
  // A key's 8 lanes read its channels 16 bytes each, side by side: in pass u lane li
  // takes channels (u * 8 + li) * 8 .. +7, so each load instruction of the 8 lanes is 128
  // contiguous bytes. Queries swizzled to match: channel d sits at
  // ((d / 64) * 8 + d % 8) * 8 + (d / 8) % 8, so the 8 lanes read 8 consecutive words.
  __shared__ float qs[GP][HD];
  __shared__ float ps[GP][ATTN_TILE];
  __shared__ float m_s[GP], l_s[GP], alpha_s[GP];
  __shared__ float red[TP > 1 ? TP - 1 : 1][GP][HD];

  const int bh = blockIdx.x, sp = blockIdx.y;
  const int b = bh / NKV, kh = bh % NKV;
  const long long pos = pos_ptr[b];
  const long long end = min((long long)sp * chunk + chunk, pos + 1);
  // A sliding layer's first visible position (window > 0); tiles wholly before it skipped
  // (the first one read holds it, so a tile never has every score masked).
  const long long lo = window > 0 ? max(pos + 1 - window, 0LL) : 0LL;
  const long long start = max((long long)sp * chunk, lo / ATTN_TILE * ATTN_TILE);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int li = lane % LANES_PER_TOKEN, lg = lane / LANES_PER_TOKEN;

  load_queries<GP, HD, ATTN_THREADS>(q + ((size_t)b * NH + kh * group) * HD, qs, group, 1.0f, [](int d) {
    return ((d / 64) * 8 + d % 8) * LANES_PER_TOKEN + (d / 8) % 8;
  });
  if (tid < GP) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  const int dp = tid % PAIRS, tp = tid / PAIRS;
  float a0[GP], a1[GP];
#pragma unroll
  for (int g = 0; g < GP; g++) a0[g] = a1[g] = 0.0f;
  const size_t base = (size_t)bh * max_len * HD;
  __syncthreads();

  for (long long t0 = start; t0 < end; t0 += ATTN_TILE) {
    const int n = (int)min((long long)ATTN_TILE, end - t0);
    // The thread's values of the tile (its first VPRE positions) loaded before the scores,
    // which they do not depend on: their trip to memory overlaps the keys', where loads
    // issued after the softmax took one more round trip per four positions.
    Pair<C> vpre[VPRE];
#pragma unroll
    for (int k = 0; k < VPRE; k++) {
      const int tt = tp + k * TP;
      if (tt < n) vpre[k] = *reinterpret_cast<const Pair<C>*>(vc + base + (size_t)(t0 + tt) * HD + 2 * dp);
    }
    // Scores: warp w takes positions w*16 .. w*16+15, four at a time (the four passes'
    // loads in flight together, but for head_dim 256, whose keys would not fit the registers).
#pragma unroll(HD <= 128 ? 4 : 1)
    for (int j = 0; j < ATTN_TILE / (WARPS * KEYS_PER_PASS); j++) {
      const int tt = warp * (ATTN_TILE / WARPS) + j * KEYS_PER_PASS + lg;
      float kf[EPL];
      if (tt < n) {
        const uint4* src = reinterpret_cast<const uint4*>(kc + base + (size_t)(t0 + tt) * HD) + li;
#pragma unroll
        for (int u = 0; u < EPL / 8; u++) {
          const uint4 word = src[u * LANES_PER_TOKEN];
          const C* vals = reinterpret_cast<const C*>(&word);
#pragma unroll
          for (int e = 0; e < 8; e++) kf[u * 8 + e] = to_f(vals[e]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < EPL; e++) kf[e] = 0.0f;
      }
#pragma unroll
      for (int g = 0; g < GP; g++) {
        if (g >= group) break;
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; e++) s += kf[e] * qs[g][e * LANES_PER_TOKEN + li];
        for (int o = LANES_PER_TOKEN / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (li == 0) ps[g][tt] = tt < n && t0 + tt >= lo ? s : -INFINITY;
      }
    }
    __syncthreads();
    softmax_tile<WARPS>(ps, m_s, l_s, alpha_s, group, warp, lane);
    __syncthreads();
    // Values.
#pragma unroll
    for (int g = 0; g < GP; g++) {
      if (g >= group) break;
      a0[g] *= alpha_s[g];
      a1[g] *= alpha_s[g];
    }
#pragma unroll
    for (int k = 0; k < VPRE; k++) {
      const int tt = tp + k * TP;
      if (tt >= n) break;
      const float x = to_f(vpre[k].x), y = to_f(vpre[k].y);
#pragma unroll
      for (int g = 0; g < GP; g++) {
        if (g >= group) break;
        const float p = ps[g][tt];
        a0[g] += p * x;
        a1[g] += p * y;
      }
    }
    // The rest (head_dim 256), four positions' values loaded before any is used.
    for (int t4 = tp + VPRE * TP; t4 < n; t4 += 4 * TP) {
      float v0[4], v1[4];
#pragma unroll
      for (int u = 0; u < 4; u++) {
        const int tt = t4 + u * TP;
        v0[u] = v1[u] = 0.0f;
        if (tt < n) {
          const Pair<C> pair = *reinterpret_cast<const Pair<C>*>(vc + base + (size_t)(t0 + tt) * HD + 2 * dp);
          v0[u] = to_f(pair.x);
          v1[u] = to_f(pair.y);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; u++) {
        const int tt = t4 + u * TP;
        if (tt >= n) break;
#pragma unroll
        for (int g = 0; g < GP; g++) {
          if (g >= group) break;
          const float p = ps[g][tt];
          a0[g] += p * v0[u];
          a1[g] += p * v1[u];
        }
      }
    }
    __syncthreads();
  }
  store_split<GP, HD, TP>(a0, a1, red, m_s, l_s, group, tp, dp, ((size_t)bh * splits + sp) * GP, acc, ml);
  merge_if_last<GP, HD, ATTN_THREADS>(done, bh, splits, group, acc, ml, out + ((size_t)b * NH + kh * group) * HD);
}

// ---- attention on tensor cores (mma.sync m16n8k16), head_dim 64 or 128, up to 8 query rows --
// The layout is attention_mma.cuh's. Channel and key orders are chosen so every load is 16
// contiguous bytes of a cache row:
// - scores: k-step s = 2j + h of the dot product takes, at fragment k {2c, 2c+1} and
//   {2c+8, 2c+9} (c = lane % 4), channels 32j + 8c + 4h + {0, 1} and {2, 3}; a lane loads
//   channels 32j + 8c .. +7 of its keys r and r + 8 (r = lane / 4) and of query row r;
// - values: a lane loads channels CPR r .. CPR r + CPR - 1 of its keys 2c, 2c + 1, 2c + 8,
//   2c + 9 (one 16-byte word at head_dim 64, two at 128).
template <typename C, int HD, int GP>
__global__ void __launch_bounds__(ATTN_THREADS)
    attn_mma_kernel(const C* __restrict__ q, const C* __restrict__ kc, const C* __restrict__ vc,
                    const long long* __restrict__ pos_ptr, float* __restrict__ acc, float* __restrict__ ml,
                    int* __restrict__ done, C* __restrict__ out, int NH, int NKV, int max_len, int chunk, int splits,
                    int group, int window) {
  static_assert(HD == 64 || HD == 128, "head_dim 64 or 128");
  static_assert(GP <= MMA_ROWS, "up to 8 query rows a KV head");
  constexpr int WARPS = ATTN_THREADS / 32;
  constexpr int KW = HD / 32;  // a key's 16-byte words a lane loads (scores)
  constexpr int CPR = HD / 8;  // a value row's channels a lane loads: CPR r .. CPR r + CPR - 1
  constexpr int VW = CPR / 8;  // ... in 16-byte words
  static_assert(ATTN_TILE / WARPS == MMA_WPOS, "16 positions a warp");
  __shared__ __align__(16) C ps[WARPS][MMA_ROWS][MMA_WPOS + 8];  // a warp's P, rows x keys (padded)

  const int bh = blockIdx.x, sp = blockIdx.y;
  const int b = bh / NKV, kh = bh % NKV;
  const long long split_at = (long long)sp * chunk;
  const long long lim = min(split_at + chunk, (long long)max_len);  // what the chunk may hold
  const long long pos = pos_ptr[b];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, c = lane & 3;
  const size_t base = (size_t)bh * max_len * HD;

  // A tile's keys (r, r + 8) and values (2c, 2c + 1, 2c + 8, 2c + 9) of this warp's 16
  // positions; the first tile's loaded before the position and the queries arrive.
  uint4 kw[2][KW], vw[4][VW], kn[2][KW], vn[4][VW];
  const auto load_tile = [&](long long t0, uint4 (&ko)[2][KW], uint4 (&vo)[4][VW]) {
    const long long p0 = t0 + warp * MMA_WPOS;
#pragma unroll
    for (int u = 0; u < 2; u++) {
      const long long t = p0 + r + 8 * u;
      const uint4* src = reinterpret_cast<const uint4*>(kc + base + (size_t)t * HD) + c;
#pragma unroll
      for (int j = 0; j < KW; j++) ko[u][j] = t < lim ? src[4 * j] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const long long t = p0 + 2 * c + (u & 1) + 8 * (u >> 1);
      const uint4* src = reinterpret_cast<const uint4*>(vc + base + (size_t)t * HD + CPR * r);
#pragma unroll
      for (int j = 0; j < VW; j++) vo[u][j] = t < lim ? src[j] : make_uint4(0, 0, 0, 0);
    }
  };
  // (Not in a sliding layer, whose first tile the position moves: loaded once it is known.)
  if (window == 0 && split_at < lim) load_tile(split_at, kw, vw);

  // The queries as the scores' B fragments: row r, channels 32j + 8c .. +7 (zeros past the group).
  uint4 qw[KW];
  {
    const C* row = q + ((size_t)b * NH + kh * group + min(r, group - 1)) * HD;
#pragma unroll
    for (int j = 0; j < KW; j++) {
      qw[j] = reinterpret_cast<const uint4*>(row)[4 * j + c];
      if (r >= group) qw[j] = make_uint4(0, 0, 0, 0);
    }
  }
  MmaState<HD / 16> st;
  const long long end = min(split_at + chunk, pos + 1);
  // A sliding layer's first visible position (window > 0); tiles wholly before it skipped,
  // and a warp's keys all before it masked (mma_tile_values takes such a warp).
  const long long lo = window > 0 ? max(pos + 1 - window, 0LL) : 0LL;
  const long long start = max(split_at, lo / ATTN_TILE * ATTN_TILE);
  if (window > 0 && start < lim) load_tile(start, kw, vw);

  for (long long t0 = start; t0 < end; t0 += ATTN_TILE) {
    const bool more = t0 + ATTN_TILE < end;
    if (more) load_tile(t0 + ATTN_TILE, kn, vn);  // the next tile's loads in flight meanwhile
    const long long p0 = t0 + warp * MMA_WPOS;
    if (p0 < end) {  // else the warp's positions all past the sequence's (warp-uniform)
#pragma unroll
    for (int u = 0; u < 4; u++) {
      if (p0 + 2 * c + (u & 1) + 8 * (u >> 1) >= end) {
#pragma unroll
        for (int j = 0; j < VW; j++) vw[u][j] = make_uint4(0, 0, 0, 0);
      }
    }
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma_scores<C, KW>(s, kw, qw);
    mma_tile_values<C, HD>(s, p0 + r < end && p0 + r >= lo, p0 + r + 8 < end && p0 + r + 8 >= lo, vw, ps[warp], st,
                           r, c);
    }
    if (more) {
#pragma unroll
      for (int u = 0; u < 2; u++)
#pragma unroll
        for (int j = 0; j < KW; j++) kw[u][j] = kn[u][j];
#pragma unroll
      for (int u = 0; u < 4; u++)
#pragma unroll
        for (int j = 0; j < VW; j++) vw[u][j] = vn[u][j];
    }
  }
  mma_finish<C, GP, HD, ATTN_THREADS>(st, group, bh, sp, splits, acc, ml, done,
                                      out + ((size_t)b * NH + kh * group) * HD);
}

// ---- SiLU * up -----------------------------------------------------------------------
// gate/up [B, 2F] -> silu(gate) * up [B, F]; `paired`: the INT4 kernel's paired column
// order (each 16 columns are 8 gate then the same 8 up).
template <typename G, typename O>
__global__ void silu_mul_kernel(const G* __restrict__ gu, O* __restrict__ out, int F, int paired) {
  const int row = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= F) return;
  const size_t gate_at = paired ? (size_t)(i / 8) * 16 + i % 8 : (size_t)i;
  const size_t up_at = paired ? gate_at + 8 : (size_t)F + i;
  const float gate = to_f(gu[(size_t)row * 2 * F + gate_at]);
  const float up = to_f(gu[(size_t)row * 2 * F + up_at]);
  out[(size_t)row * F + i] = from_f<O>(gate / (1.0f + __expf(-gate)) * up);
}

// Where a split kernel's partial sums, their softmax and its output go.
struct Merge {
  float* acc;
  float* ml;
  int* done;
  void* out;
};

template <typename C, int HD, int GP>
cudaError_t launch_split(const void* q, const void* kc, const void* vc, const long long* pos, const Merge& m, int B,
                         int NH, int NKV, int max_len, int chunk, int splits, int window, cudaStream_t s) {
  const dim3 grid(B * NKV, splits);
  if constexpr (HD <= 128 && GP <= MMA_ROWS) {
    attn_mma_kernel<C, HD, GP><<<grid, ATTN_THREADS, 0, s>>>(
        static_cast<const C*>(q), static_cast<const C*>(kc), static_cast<const C*>(vc), pos, m.acc, m.ml, m.done,
        static_cast<C*>(m.out), NH, NKV, max_len, chunk, splits, NH / NKV, window);
    return cudaGetLastError();
  }
  attn_split_kernel<C, HD, GP><<<grid, ATTN_THREADS, 0, s>>>(
      static_cast<const C*>(q), static_cast<const C*>(kc), static_cast<const C*>(vc), pos, m.acc, m.ml, m.done,
      static_cast<C*>(m.out), NH, NKV, max_len, chunk, splits, NH / NKV, window);
  return cudaGetLastError();
}

template <typename C, int HD>
cudaError_t split_for_group(int gp, const void* q, const void* kc, const void* vc, const long long* pos,
                            const Merge& m, int B, int NH, int NKV, int max_len, int chunk, int splits, int window,
                            cudaStream_t s) {
  if (gp == 4) return launch_split<C, HD, 4>(q, kc, vc, pos, m, B, NH, NKV, max_len, chunk, splits, window, s);
  if (gp == 8) return launch_split<C, HD, 8>(q, kc, vc, pos, m, B, NH, NKV, max_len, chunk, splits, window, s);
  if (gp == 16) return launch_split<C, HD, 16>(q, kc, vc, pos, m, B, NH, NKV, max_len, chunk, splits, window, s);
  return cudaErrorInvalidValue;
}

}  // namespace

extern "C" {

// Every entry returns a cudaError_t (0: launched). dtype codes: 0 bfloat16, 1 float16,
// 2 float32. Tensors are contiguous; positions and rows are int64 on the device.

int edge_add_rmsnorm(float* x, const void* delta, int delta_dtype, const void* w, void* h, int dtype, int B, int H,
                     float eps, void* stream) {
  if (H < 1 || H > NORM_THREADS * NORM_VALUES) return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return int(with_types(delta_dtype, dtype, [&](auto* dd, auto* t) {
    using D = std::remove_pointer_t<decltype(dd)>;
    using T = std::remove_pointer_t<decltype(t)>;
    // Four values a load where every row starts aligned for it; one otherwise.
    const auto aligned = [](const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
    const bool vec4 = H % 4 == 0 && aligned(x, 16) && aligned(delta, 4 * sizeof(D)) && aligned(w, 4 * sizeof(T)) &&
                      aligned(h, 4 * sizeof(T));
    const int per = vec4 ? 4 : 1;
    const int loads = (H / per + NORM_THREADS - 1) / NORM_THREADS;  // fewest loads a thread, most threads
    const int threads = max(32, ((H / per + loads - 1) / loads + 31) / 32 * 32);
    if (vec4) {
      add_rmsnorm_kernel<D, T, 4><<<B, threads, 0, s>>>(x, static_cast<const D*>(delta), static_cast<const T*>(w),
                                                        static_cast<T*>(h), H, eps);
    } else {
      add_rmsnorm_kernel<D, T, 1><<<B, threads, 0, s>>>(x, static_cast<const D*>(delta), static_cast<const T*>(w),
                                                        static_cast<T*>(h), H, eps);
    }
    return cudaGetLastError();
  }));
}

// slots: each row's cache slot (nullptr: its position); rot: the channels of a head the
// rotary turns, the tables' width (HD but for a partial rotary).
int edge_rope_kv_write(const void* qkv, int qkv_dtype, const float* cos, const float* sin, const long long* pos,
                       const long long* slots, void* q, void* kc, void* vc, int cache_dtype, int B, int NH, int NKV,
                       int max_len, float q_scale, int HD, int rot, void* stream) {
  if (HD % 2 != 0 || HD > 2048 || rot % 2 != 0 || rot < 2 || rot > HD) return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return int(with_types(qkv_dtype, cache_dtype, [&](auto* qt, auto* ct) {
    using Q = std::remove_pointer_t<decltype(qt)>;
    using C = std::remove_pointer_t<decltype(ct)>;
    rope_kv_kernel<Q, C><<<dim3(B, NH + 2 * NKV), HD / 2, 0, s>>>(
        static_cast<const Q*>(qkv), cos, sin, pos, slots == nullptr ? pos : slots, static_cast<C*>(q),
        static_cast<C*>(kc), static_cast<C*>(vc), NH, NKV, max_len, q_scale, HD, rot);
    return cudaGetLastError();
  }));
}

int edge_rope_prefill(const void* qkv, int qkv_dtype, const float* cos, const float* sin, const long long* row,
                      void* q, void* k, void* v, void* kc, void* vc, int cache_dtype, int T, int NH, int NKV,
                      int max_len, float q_scale, int HD, void* stream) {
  if (HD % 2 != 0 || HD > 2048) return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return int(with_types(qkv_dtype, cache_dtype, [&](auto* qt, auto* ct) {
    using Q = std::remove_pointer_t<decltype(qt)>;
    using C = std::remove_pointer_t<decltype(ct)>;
    rope_prefill_kernel<Q, C><<<dim3(T, NH + 2 * NKV), HD / 2, 0, s>>>(
        static_cast<const Q*>(qkv), cos, sin, row, static_cast<C*>(q), static_cast<C*>(k), static_cast<C*>(v),
        static_cast<C*>(kc), static_cast<C*>(vc), T, NH, NKV, max_len, q_scale, HD);
    return cudaGetLastError();
  }));
}

// q [B, NH, HD] (pre-scaled) against cache positions 0..pos[b] (window > 0: a sliding
// layer's, only the last `window` of them) -> out [B, NH, HD] in the cache's type. acc
// [B * NKV * splits * gp, HD] and ml [..., 2] float32 scratch; done [B * NKV] int32 zeros,
// left zeros (the split blocks' count, see merge_if_last); gp (4, 8 or 16) at least
// NH / NKV; head_dim 64, 128 or 256; splits and chunk as the caller's rule.
int edge_decode_attention(const void* q, const void* kc, const void* vc, const long long* pos, float* acc, float* ml,
                          int* done, void* out, int dtype, int B, int NH, int NKV, int max_len, int HD, int gp,
                          int chunk, int splits, int window, void* stream) {
  if (NH % NKV != 0 || NH / NKV > gp || dtype == 2 || chunk < 1 || splits < 1 || splits > MAX_SPLITS || window < 0)
    return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const Merge m{acc, ml, done, out};
  return int(with_type(dtype, [&](auto* ct) {
    using C = std::remove_pointer_t<decltype(ct)>;
    if constexpr (std::is_same_v<C, float>) {
      return cudaErrorInvalidValue;
    } else {
      const auto run = [&](auto hd) {
        return split_for_group<C, decltype(hd)::value>(gp, q, kc, vc, pos, m, B, NH, NKV, max_len, chunk, splits,
                                                       window, s);
      };
      if (HD == 64) return run(std::integral_constant<int, 64>{});
      if (HD == 128) return run(std::integral_constant<int, 128>{});
      if (HD == 256) return run(std::integral_constant<int, 256>{});
      return cudaErrorInvalidValue;
    }
  }));
}

int edge_silu_mul(const void* gate_up, int in_dtype, void* out, int out_dtype, int B, int F, int paired,
                  void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return int(with_types(in_dtype, out_dtype, [&](auto* it, auto* ot) {
    using G = std::remove_pointer_t<decltype(it)>;
    using O = std::remove_pointer_t<decltype(ot)>;
    silu_mul_kernel<G, O><<<dim3((F + 255) / 256, B), 256, 0, s>>>(static_cast<const G*>(gate_up),
                                                                   static_cast<O*>(out), F, paired);
    return cudaGetLastError();
  }));
}

}  // extern "C"
