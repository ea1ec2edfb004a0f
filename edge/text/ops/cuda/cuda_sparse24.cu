// 2:4 sparse INT4 weights on CUDA: a decode GEMV over the packed format, and its
// dequantization for prefill products (cuBLAS multiplies the dequantized slab).
//
// The layout is the checkpoint's, as edge/text/ops/sparse24.py writes it, read as it is:
//   codes24 uint8 [N, K/4]   per four inputs the two kept codes (low nibble: the lower position)
//   index24 uint8 [N, K/8]   their positions, 2 bits each (i0 < i1), the even four in a byte's
//                            low nibble
//   scales  half  [N, K/G]   zeros uint8 [N, K/G]; kept weight = (code - zero) * scale, pruned 0.
//
// GEMV: a warp per weight row. A lane reads one 32-bit word of codes (four fours: 16 inputs)
// and the 16 bits of their positions at a time, so a warp's loads of a row are contiguous,
// 128 bytes of codes and 64 of positions a step; each kept weight meets its one activation
// (x[4f + i]), so the multiplies are half a dense GEMV's and the bytes three eighths of a
// byte a weight (plus scales). Sums in float32, reduced across the warp by shuffles. This
// is the plain packed GEMV; the sparse tensor-core instruction (mma.sp) is not used here.
//
// Built on the box by edge/text/ops/cuda/cuda_sparse24.py (cuda_build.py: nvcc, sm_80+).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int WARPS = 4;  // weight rows (warps) per block
constexpr int MAX_M = 8;  // activation rows a GEMV takes (a decode batch)

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void __launch_bounds__(WARPS * 32)
    sparse24_gemv(const uint32_t* __restrict__ codes, const uint16_t* __restrict__ index,
                  const __half* __restrict__ scales, const uint8_t* __restrict__ zeros, const T* __restrict__ x,
                  float* __restrict__ out, int M, int N, int K, int G) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (row >= N) return;
  const int words = K / 16;  // 16 inputs a word of codes
  const int groups = K / G;
  const uint32_t* c_row = codes + (size_t)row * words;
  const uint16_t* i_row = index + (size_t)row * words;
  const __half* s_row = scales + (size_t)row * groups;
  const uint8_t* z_row = zeros + (size_t)row * groups;
  float acc[MAX_M];
#pragma unroll
  for (int m = 0; m < MAX_M; m++) acc[m] = 0.f;
  for (int w = lane; w < words; w += 32) {
    const uint32_t c = __ldg(c_row + w);
    const uint32_t ix = __ldg(i_row + w);
    const int g = (w * 16) / G;  // G is a multiple of 16: a word lies in one group
    const float s = __half2float(s_row[g]);
    const float z = float(z_row[g]);
#pragma unroll
    for (int f = 0; f < 4; f++) {
      const int base = w * 16 + f * 4;
      const uint32_t byte = (c >> (8 * f)) & 0xFF;
      const uint32_t pos = (ix >> (4 * f)) & 0xF;
      const float w0 = (float(byte & 15) - z) * s;
      const float w1 = (float(byte >> 4) - z) * s;
      const int k0 = base + (pos & 3), k1 = base + (pos >> 2);
#pragma unroll
      for (int m = 0; m < MAX_M; m++) {
        if (m < M) {
          const T* xm = x + (size_t)m * K;
          acc[m] = fmaf(w0, to_float(xm[k0]), acc[m]);
          acc[m] = fmaf(w1, to_float(xm[k1]), acc[m]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MAX_M; m++) {
    if (m < M) {
      float v = acc[m];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0) out[(size_t)m * N + row] = v;
    }
  }
}

// One thread per four of inputs: writes the four dense weights of rows [row0, row0 + rows).
template <typename T>
__global__ void sparse24_dequant(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ index,
                                 const __half* __restrict__ scales, const uint8_t* __restrict__ zeros,
                                 T* __restrict__ out, int row0, int rows, int K, int G) {
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int fours = K / 4;
  if (t >= (long long)rows * fours) return;
  const int r = int(t / fours), f = int(t % fours);
  const int row = row0 + r;
  const uint32_t byte = codes[(size_t)row * fours + f];
  const uint32_t pos = (index[(size_t)row * (K / 8) + f / 2] >> (4 * (f & 1))) & 0xF;
  const int g = (f * 4) / G;
  const float s = __half2float(scales[(size_t)row * (K / G) + g]);
  const float z = float(zeros[(size_t)row * (K / G) + g]);
  float w[4] = {0.f, 0.f, 0.f, 0.f};
  w[pos & 3] = (float(byte & 15) - z) * s;
  w[pos >> 2] = (float(byte >> 4) - z) * s;
  T* o = out + (size_t)r * K + f * 4;
#pragma unroll
  for (int i = 0; i < 4; i++) o[i] = from_float<T>(w[i]);
}

}  // namespace

extern "C" {

// x [M, K] in dtype (0 bfloat16, 1 float16, 2 float32), out [M, N] float32; M 1..8, K a
// multiple of 16, G a multiple of 16 dividing K; codes 4-byte and index 2-byte aligned.
// Returns a cudaError_t (0: launched).
int edge_sparse24_gemv(const void* codes, const void* index, const void* scales, const void* zeros, const void* x,
                       float* out, int M, int N, int K, int G, int dtype, void* stream) {
  if (M < 1 || M > MAX_M || K % 16 != 0 || G % 16 != 0 || K % G != 0 || N < 1) return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const dim3 grid(unsigned((N + WARPS - 1) / WARPS));
  const auto* c = static_cast<const uint32_t*>(codes);
  const auto* ix = static_cast<const uint16_t*>(index);
  const auto* sc = static_cast<const __half*>(scales);
  const auto* z = static_cast<const uint8_t*>(zeros);
  if (dtype == 0) {
    sparse24_gemv<__nv_bfloat16><<<grid, WARPS * 32, 0, s>>>(c, ix, sc, z, static_cast<const __nv_bfloat16*>(x), out,
                                                             M, N, K, G);
  } else if (dtype == 1) {
    sparse24_gemv<__half><<<grid, WARPS * 32, 0, s>>>(c, ix, sc, z, static_cast<const __half*>(x), out, M, N, K, G);
  } else if (dtype == 2) {
    sparse24_gemv<float><<<grid, WARPS * 32, 0, s>>>(c, ix, sc, z, static_cast<const float*>(x), out, M, N, K, G);
  } else {
    return int(cudaErrorInvalidValue);
  }
  return int(cudaGetLastError());
}

// out [rows, K] in dtype (0 bfloat16, 1 float16, 2 float32): weight rows row0.. dequantized.
int edge_sparse24_dequant(const void* codes, const void* index, const void* scales, const void* zeros, void* out,
                          int row0, int rows, int K, int G, int dtype, void* stream) {
  if (K % 16 != 0 || G % 16 != 0 || K % G != 0 || rows < 1) return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const long long threads = (long long)rows * (K / 4);
  const int block = 256;
  const dim3 grid(unsigned((threads + block - 1) / block));
  const auto* c = static_cast<const uint8_t*>(codes);
  const auto* ix = static_cast<const uint8_t*>(index);
  const auto* sc = static_cast<const __half*>(scales);
  const auto* z = static_cast<const uint8_t*>(zeros);
  if (dtype == 0) {
    sparse24_dequant<__nv_bfloat16><<<grid, block, 0, s>>>(c, ix, sc, z, static_cast<__nv_bfloat16*>(out), row0,
                                                           rows, K, G);
  } else if (dtype == 1) {
    sparse24_dequant<__half><<<grid, block, 0, s>>>(c, ix, sc, z, static_cast<__half*>(out), row0, rows, K, G);
  } else if (dtype == 2) {
    sparse24_dequant<float><<<grid, block, 0, s>>>(c, ix, sc, z, static_cast<float*>(out), row0, rows, K, G);
  } else {
    return int(cudaErrorInvalidValue);
  }
  return int(cudaGetLastError());
}

}  // extern "C"
