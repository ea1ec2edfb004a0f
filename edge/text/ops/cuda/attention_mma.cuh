// The tensor-core (mma.sync m16n8k16) pieces our split attention kernels share: the float
// cache's (decode_ops.cu) and the quantized cache's (kv_ops.cu). A block's four warps each
// take 16 positions of every 64-position tile with their own online softmax, up to 8 query
// rows a KV head:
// - scores as S^T = K Q^T: 16 keys (the m side) x 8 query rows (the n side, so a group of
//   4 or 8 wastes nothing of the m side); lane (r = lane / 4, c = lane % 4) holds keys r
//   and r + 8 of rows 2c and 2c + 1;
// - values as O^T = V^T P^T: 16 channels x 8 rows; with CPR = HD / 8 channels a lane row,
//   m-tile i's rows r and r + 8 are channels CPR r + 2i and CPR r + 2i + 1, so a lane
//   reads channels CPR r .. CPR r + CPR - 1 of its keys 2c, 2c + 1, 2c + 8, 2c + 9 as
//   neighbours in memory.
#pragma once

#include <string.h>

#include <type_traits>

#include "attention_common.cuh"

namespace edge_cuda {

constexpr int MMA_ROWS = 8;   // query rows a KV head the tensor-core kernels take
constexpr int MMA_WPOS = 16;  // positions a warp takes of a 64-position tile

template <typename C>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<C, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

template <typename C>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
  if constexpr (std::is_same_v<C, __half>) {
    const __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

template <typename C>
__device__ __forceinline__ float2 unpack2(uint32_t bits) {  // pack2's inverse
  if constexpr (std::is_same_v<C, __half>) {
    __half2 h;
    memcpy(&h, &bits, sizeof h);
    return __half22float2(h);
  } else {
    __nv_bfloat162 h;
    memcpy(&h, &bits, sizeof h);
    return __bfloat1622float2(h);
  }
}

__device__ __forceinline__ uint32_t word(const uint4& w, int i) {
  return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
}

__device__ __forceinline__ void set_word(uint4& w, int i, uint32_t v) {
  if (i == 0) w.x = v;
  else if (i == 1) w.y = v;
  else if (i == 2) w.z = v;
  else w.w = v;
}

// One 8-channel group of a warp's scores S^T += K Q^T: a lane's words of key r (a0) and
// key r + 8 (a1), as A fragments, against its words of query row r (b, B fragments).
template <typename C>
__device__ __forceinline__ void mma_scores_step(float (&d)[4], const uint32_t (&a0)[4], const uint32_t (&a1)[4],
                                                const uint32_t (&b)[4]) {
#pragma unroll
  for (int h = 0; h < 2; h++) mma_16816<C>(d, a0[2 * h], a1[2 * h], a0[2 * h + 1], a1[2 * h + 1], b[2 * h], b[2 * h + 1]);
}

// A warp's scores S^T += K Q^T for its 16 keys (kw[0]: key r, kw[1]: key r + 8, as A
// fragments) and the query rows (qb, B fragments), over KW groups of 32 channels.
template <typename C, int KW>
__device__ __forceinline__ void mma_scores(float (&d)[4], const uint4 (&kw)[2][KW], const uint4 (&qb)[KW]) {
#pragma unroll
  for (int j = 0; j < KW; j++) {
    const uint32_t a0[4] = {kw[0][j].x, kw[0][j].y, kw[0][j].z, kw[0][j].w};
    const uint32_t a1[4] = {kw[1][j].x, kw[1][j].y, kw[1][j].z, kw[1][j].w};
    const uint32_t b[4] = {qb[j].x, qb[j].y, qb[j].z, qb[j].w};
    mma_scores_step<C>(d, a0, a1, b);
  }
}

// A warp's running softmax of rows 2c (m0, l0) and 2c + 1 (m1, l1) and its sums o.
template <int MT>
struct MmaState {
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
  float o[MT][4] = {};
};

// One warp's 16 positions of a tile after their scores s (keys r: s0, s1; r + 8: s2, s3;
// rows 2c: s0, s2; 2c + 1: s1, s3): keys at or past `live` masked, the online softmax
// stepped, and the values vw (keys 2c, 2c + 1, 2c + 8, 2c + 9; CPR channels each as
// packed words, zeros where a key is past the sequence: what the cache holds there may be
// anything, and NaN times a zero weight is NaN) added to o through the warp's shared P
// rows pw. A warp may have every key masked (a sliding layer's window starts past them).
template <typename C, int HD>
__device__ __forceinline__ void mma_tile_values(float (&s)[4], bool in0, bool in1, const uint4 (&vw)[4][HD / 64],
                                                C (*pw)[MMA_WPOS + 8], MmaState<HD / 16>& st, int r, int c) {
  constexpr int MT = HD / 16;
  if (!in0) s[0] = s[1] = -INFINITY;
  if (!in1) s[2] = s[3] = -INFINITY;
  float x0 = fmaxf(s[0], s[2]), x1 = fmaxf(s[1], s[3]);
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
    x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
  }
  const float n0 = fmaxf(st.m0, x0), n1 = fmaxf(st.m1, x1);
  // Every key so far masked (a sliding layer's warp wholly before the window): nothing to
  // rescale and nothing to add, without the NaN of -inf less -inf.
  const float z0 = n0 == -INFINITY ? 0.0f : n0, z1 = n1 == -INFINITY ? 0.0f : n1;
  const float al0 = __expf(st.m0 - z0), al1 = __expf(st.m1 - z1);
  st.m0 = n0;
  st.m1 = n1;
  const float p00 = __expf(s[0] - z0), p01 = __expf(s[1] - z1), p10 = __expf(s[2] - z0), p11 = __expf(s[3] - z1);
  st.l0 = st.l0 * al0 + p00 + p10;
  st.l1 = st.l1 * al1 + p01 + p11;
#pragma unroll
  for (int i = 0; i < MT; i++) {
    st.o[i][0] *= al0;
    st.o[i][2] *= al0;
    st.o[i][1] *= al1;
    st.o[i][3] *= al1;
  }
  // P to the values' B fragments (row r, keys 2c, 2c + 1 and 2c + 8, 2c + 9) through the
  // warp's shared rows.
  pw[2 * c][r] = from_f<C>(p00);
  pw[2 * c + 1][r] = from_f<C>(p01);
  pw[2 * c][r + 8] = from_f<C>(p10);
  pw[2 * c + 1][r + 8] = from_f<C>(p11);
  __syncwarp();
  const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&pw[r][2 * c]);
  const uint32_t b1 = *reinterpret_cast<const uint32_t*>(&pw[r][2 * c + 8]);
  __syncwarp();
#pragma unroll
  for (int i = 0; i < MT; i++) {
    // Channels CPR r + 2i (m row r) and CPR r + 2i + 1 (m row r + 8) of keys 2c, 2c + 1 (a0,
    // a1) and 2c + 8, 2c + 9 (a2, a3): word i % 4 of value word i / 4 holds both channels.
    const uint32_t k0 = word(vw[0][i / 4], i % 4), k1 = word(vw[1][i / 4], i % 4);
    const uint32_t k8 = word(vw[2][i / 4], i % 4), k9 = word(vw[3][i / 4], i % 4);
    mma_16816<C>(st.o[i], __byte_perm(k0, k1, 0x5410), __byte_perm(k0, k1, 0x7632), __byte_perm(k8, k9, 0x5410),
                 __byte_perm(k8, k9, 0x7632), b0, b1);
  }
}

// The end of a tensor-core split kernel: the warps' sums combined (each row's sum of
// exponentials over the warp, then every warp's sums rescaled to the block's max, added
// in warp order), the chunk's partial sums and softmax stored at its slots, and the
// merge (merge_if_last) by the KV head's last block to finish into out.
template <typename C, int GP, int HD, int THREADS>
__device__ __forceinline__ void mma_finish(MmaState<HD / 16>& st, int group, int bh, int sp, int splits,
                                           float* __restrict__ acc, float* __restrict__ ml, int* __restrict__ done,
                                           C* __restrict__ out) {
  constexpr int WARPS = THREADS / 32;
  constexpr int MT = HD / 16, CPR = HD / 8;
  __shared__ float wm[WARPS][MMA_ROWS], wl[WARPS][MMA_ROWS];
  __shared__ float red[WARPS][GP][HD];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, c = lane & 3;
  float l0 = st.l0, l1 = st.l1;
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  if (r == 0) {
    wm[warp][2 * c] = st.m0;
    wm[warp][2 * c + 1] = st.m1;
    wl[warp][2 * c] = l0;
    wl[warp][2 * c + 1] = l1;
  }
  __syncthreads();
  float top0 = -INFINITY, top1 = -INFINITY;
#pragma unroll
  for (int w = 0; w < WARPS; w++) {
    top0 = fmaxf(top0, wm[w][2 * c]);
    top1 = fmaxf(top1, wm[w][2 * c + 1]);
  }
  const float e0 = st.m0 == -INFINITY ? 0.0f : __expf(st.m0 - top0);
  const float e1 = st.m1 == -INFINITY ? 0.0f : __expf(st.m1 - top1);
#pragma unroll
  for (int i = 0; i < MT; i++) {
    if (2 * c < group) {
      red[warp][2 * c][CPR * r + 2 * i] = st.o[i][0] * e0;
      red[warp][2 * c][CPR * r + 2 * i + 1] = st.o[i][2] * e0;
    }
    if (2 * c + 1 < group) {
      red[warp][2 * c + 1][CPR * r + 2 * i] = st.o[i][1] * e1;
      red[warp][2 * c + 1][CPR * r + 2 * i + 1] = st.o[i][3] * e1;
    }
  }
  __syncthreads();
  const size_t first_slot = ((size_t)bh * splits + sp) * GP;
  for (int item = threadIdx.x; item < group * HD; item += THREADS) {
    const int g = item / HD, d = item % HD;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) sum += red[w][g][d];
    acc[(first_slot + g) * HD + d] = sum;
  }
  if (threadIdx.x < group) {
    const int g = threadIdx.x;
    float top = -INFINITY, l = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) top = fmaxf(top, wm[w][g]);
#pragma unroll
    for (int w = 0; w < WARPS; w++) l += wm[w][g] == -INFINITY ? 0.0f : wl[w][g] * __expf(wm[w][g] - top);
    ml[(first_slot + g) * 2] = top;
    ml[(first_slot + g) * 2 + 1] = l;
  }
  merge_if_last<GP, HD, THREADS>(done, bh, splits, group, acc, ml, out);
}

}  // namespace edge_cuda
