// What our CUDA attention sources share (decode_ops.cu over float caches, kv_ops.cu over
// the quantized ones): type conversions, warp reductions, the rotary, the merge of an
// attention's splits, and the dispatch from a dtype code to a type. Included by each .cu
// (cuda_build.py hashes this header into every library's cache key).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace edge_cuda {

// dtype codes shared with decode_ops.py: 0 bfloat16, 1 float16, 2 float32.
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The tables hold [freqs, freqs]: the first half of a row serves both halves.
template <typename Q>
__device__ __forceinline__ void rotate(const Q* src, const float* cos, const float* sin, long long pos, int HD,
                                       int r, float* o1, float* o2) {
  const int half = HD / 2;
  const float x1 = to_f(src[r]), x2 = to_f(src[r + half]);
  const float c = cos[pos * HD + r], s = sin[pos * HD + r];
  *o1 = x1 * c - x2 * s;
  *o2 = x2 * c + x1 * s;
}

// One tile's step of the online softmax, for tiles of 64 positions: the scores ps[g][t]
// (-inf where masked) become weights; alpha_s[g] the rescale of the sums so far; m_s and
// l_s the running max and sum. Warp w updates query rows w, w + WARPS, ...
template <int WARPS>
__device__ __forceinline__ void softmax_tile(float (*ps)[64], float* m_s, float* l_s, float* alpha_s, int group,
                                             int warp, int lane) {
  for (int g = warp; g < group; g += WARPS) {
    const float s0 = ps[g][lane], s1 = ps[g][lane + 32];
    const float m_old = m_s[g];
    const float m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));
    const float p0 = __expf(s0 - m_new), p1 = __expf(s1 - m_new);
    ps[g][lane] = p0;
    ps[g][lane + 32] = p1;
    const float total = warp_sum(p0 + p1);
    if (lane == 0) {
      const float alpha = __expf(m_old - m_new);
      alpha_s[g] = alpha;
      l_s[g] = l_s[g] * alpha + total;
      m_s[g] = m_new;
    }
  }
}

// The end of a split kernel (decode_ops.cu's and kv_ops.cu's): each thread holds channels
// 2dp and 2dp+1 of every query row (a0, a1) summed over its subset tp of a tile's
// positions; the TP subsets' sums are added in a fixed order through `red` (so a
// sequence's output is the same alone or batched), and the chunk's partial sums and its
// softmax (m, l) stored at slots first_slot + g, where the merge reads them.
template <int GP, int HD, int TP>
__device__ __forceinline__ void store_split(const float (&a0)[GP], const float (&a1)[GP], float (*red)[GP][HD],
                                            const float* m_s, const float* l_s, int group, int tp, int dp,
                                            size_t first_slot, float* __restrict__ acc, float* __restrict__ ml) {
  if (TP > 1 && tp > 0) {
#pragma unroll
    for (int g = 0; g < GP; g++) {
      if (g >= group) break;
      red[tp - 1][g][2 * dp] = a0[g];
      red[tp - 1][g][2 * dp + 1] = a1[g];
    }
  }
  __syncthreads();
  if (tp == 0) {
#pragma unroll
    for (int g = 0; g < GP; g++) {
      if (g >= group) break;
      float s0 = a0[g], s1 = a1[g];
      for (int u = 0; u < TP - 1; u++) {
        s0 += red[u][g][2 * dp];
        s1 += red[u][g][2 * dp + 1];
      }
      const size_t slot = first_slot + g;
      acc[slot * HD + 2 * dp] = s0;
      acc[slot * HD + 2 * dp + 1] = s1;
      if (dp == 0) {
        ml[slot * 2] = m_s[g];
        ml[slot * 2 + 1] = l_s[g];
      }
    }
  }
}

// The GP query rows of a KV head's group (rows[g * HD + d]; those from `group` on are
// zeros) into shared memory as float, times `scale`, channel d at column place(d). Every
// load is issued before any store: a load and its store one after the other, each of a
// thread's loads waited for the store before it (a trip to memory per row, on the path
// to the first key's score).
template <int GP, int HD, int THREADS, typename C, typename Place>
__device__ __forceinline__ void load_queries(const C* __restrict__ rows, float (*qs)[HD], int group, float scale,
                                             Place place) {
  constexpr int PER = (GP * HD + THREADS - 1) / THREADS;
  float v[PER];
#pragma unroll
  for (int k = 0; k < PER; k++) {
    const int i = min((int)threadIdx.x + k * THREADS, GP * HD - 1);
    v[k] = to_f(rows[min(i / HD, group - 1) * HD + i % HD]);  // (rows past the group: read, not kept)
  }
#pragma unroll
  for (int k = 0; k < PER; k++) {
    const int i = threadIdx.x + k * THREADS;
    if (i < GP * HD) qs[i / HD][place(i % HD)] = i / HD < group ? v[k] * scale : 0.0f;
  }
}

// N neighbouring values in one load or store (16 bytes where N * sizeof(T) is).
template <typename T, int N>
struct __align__(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float* out) {
  const Vec<T, N> word = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int e = 0; e < N; e++) out[e] = to_f(word.v[e]);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float* in) {
  Vec<T, N> word;
#pragma unroll
  for (int e = 0; e < N; e++) word.v[e] = from_f<T>(in[e]);
  *reinterpret_cast<Vec<T, N>*>(p) = word;
}

// Two neighbouring channels of a cache row, read in one 4-byte load.
template <typename C>
struct __align__(2 * sizeof(C)) Pair {
  C x, y;
};

// The end of a split kernel, after store_split: the last of a KV head's split blocks to
// finish merges the chunks into out (the group's rows: out[g * HD + d]), so a layer's
// attention is one launch, not two (at batch 1 a separate merge kernel cost 4.4 us a
// layer on an H100, most of it its launch and its own trips to memory). done[bh] counts
// the finished blocks; the last resets it for the next call, which a graph replays on the
// same buffer. The others' sums are read through L2 (__ldcg): L1 is not coherent.
// Row g: the chunks weighted by exp(m_s - max m), over the weighted sum of their softmax
// denominators (chunk 0 always holds position 0: the max is finite), the chunks added in
// order (a sequence's output the same alone or batched). A thread takes four channels of
// a row and their chunks MERGE_BATCH at a time, the first batch in flight while the
// weights are computed.
constexpr int MAX_SPLITS = 128;
constexpr int MERGE_BATCH = 16;

template <int GP, int HD, int THREADS, typename C>
__device__ __forceinline__ void merge_if_last(int* __restrict__ done, int bh, int splits, int group,
                                              const float* __restrict__ acc, const float* __restrict__ ml,
                                              C* __restrict__ out) {
  constexpr int QUADS = HD / 4;
  constexpr int WARPS = THREADS / 32;
  __shared__ int last;
  __shared__ float weight[GP][MAX_SPLITS];
  __shared__ float inv_denom[GP];
  __threadfence();  // this block's sums visible before it counts itself done
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done + bh, 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) done[bh] = 0;
  const size_t first = (size_t)bh * splits * GP;  // chunk s's row g: first + s * GP + g
  const int items = group * QUADS, item0 = threadIdx.x;
  float4 vals[MERGE_BATCH];
  const auto fetch = [&](int item, int s0) {
    const int g = item / QUADS, c = item % QUADS;
#pragma unroll
    for (int k = 0; k < MERGE_BATCH; k++) {
      if (item < items && s0 + k < splits)
        vals[k] = __ldcg(reinterpret_cast<const float4*>(acc + (first + (size_t)(s0 + k) * GP + g) * HD) + c);
    }
  };
  fetch(item0, 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int g = warp; g < group; g += WARPS) {
    float2 mls[MAX_SPLITS / 32];
    float top = -INFINITY;
#pragma unroll
    for (int k = 0; k < MAX_SPLITS / 32; k++) {
      const int s = lane + 32 * k;
      mls[k] = s < splits ? __ldcg(reinterpret_cast<const float2*>(ml) + first + (size_t)s * GP + g)
                          : make_float2(-INFINITY, 0.0f);
    }
#pragma unroll
    for (int k = 0; k < MAX_SPLITS / 32; k++) top = fmaxf(top, mls[k].x);
    top = warp_max(top);
    float denom = 0.0f;
#pragma unroll
    for (int k = 0; k < MAX_SPLITS / 32; k++) {
      const int s = lane + 32 * k;
      if (s < splits) {
        const float w = __expf(mls[k].x - top);
        weight[g][s] = w;
        denom += mls[k].y * w;
      }
    }
    denom = warp_sum(denom);
    if (lane == 0) inv_denom[g] = 1.0f / denom;
  }
  __syncthreads();
  for (int item = item0; item < items; item += THREADS) {
    const int g = item / QUADS, c = item % QUADS;
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s0 = 0; s0 < splits; s0 += MERGE_BATCH) {
      if (item != item0 || s0 > 0) fetch(item, s0);
#pragma unroll
      for (int k = 0; k < MERGE_BATCH; k++) {
        if (s0 + k < splits) {
          const float w = weight[g][s0 + k];
          sum.x += vals[k].x * w;
          sum.y += vals[k].y * w;
          sum.z += vals[k].z * w;
          sum.w += vals[k].w * w;
        }
      }
    }
    const float inv = inv_denom[g];
    const float o[4] = {sum.x * inv, sum.y * inv, sum.z * inv, sum.w * inv};
    store_vec<C, 4>(out + (size_t)g * HD + 4 * c, o);
  }
}

// Calls f with a null pointer of the type a dtype code names.
template <typename F>
cudaError_t with_type(int dtype, F f) {
  switch (dtype) {
    case 0:
      return f(static_cast<__nv_bfloat16*>(nullptr));
    case 1:
      return f(static_cast<__half*>(nullptr));
    case 2:
      return f(static_cast<float*>(nullptr));
    default:
      return cudaErrorInvalidValue;
  }
}

// Calls f with null pointers of the types two dtype codes name (an input's and an output's).
template <typename F>
cudaError_t with_types(int a, int b, F f) {
  return with_type(a, [&](auto* x) { return with_type(b, [&](auto* y) { return f(x, y); }); });
}

}  // namespace edge_cuda
