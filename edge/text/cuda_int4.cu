// INT4 weight-only products on NVIDIA GPUs (sm_80 and later: Ampere, the Orin's sm_87,
// Hopper), built on the box by cuda_int4.py and called through ctypes.
//
// Layout (cuda_int4.py's repack writes it from the checkpoint's row-major codes):
//   codes   [N/16 tiles][K/64 chunks][32 lanes] of 16 bytes: one 16-byte load per lane
//           per chunk, 512 contiguous bytes per warp. A lane's four 32-bit words are the
//           A operands of four tensor-core products (mma m16n8k16), ready after a mask:
//           word h*2+i (sub-chunk h of 32 k, step i) holds, at nibble e*4 + r*2 + rh,
//           the code of row tile*16 + rh*8 + g and k = chunk*64 + h*32 + t*8 + i*4 + r*2 + e
//           for lane g*4 + t. Nibbles p and p+4 land in the two halves of one register
//           after (word >> 4j) & 0x000F000F, so no shuffles are needed.
//   scales  [N/16][K/G][16] float16, zeros [N/16][K/G][16] uint8 (0..15), the tile's rows
//           in order: the 16 rows of a tile share one small block per group.
// The k order above makes a lane's activations 8 contiguous values per sub-chunk (one
// 16-byte load), and a weight is (code - zero) * scale per group of G input channels.
//
// The product: OR-ing a code into the bits of 128.0 (bfloat16) or 1024.0 (float16) gives
// 128 + code exactly, and one packed subtraction of 128 + zero leaves (code - zero), an
// exact small integer. The tensor cores multiply those by the activations and add in
// float32 (exact products, float32 sums); the group's scale multiplies each group's sum
// once, in float32. Activation rows are the product's 8 columns, so up to 8 sequences
// share one pass over the weight, and a row's result never depends on the other rows.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

// What differs between the two activation types: the magic number a code is OR-ed
// into, the packed pair type, and the tensor-core instruction's operand type.
template <typename T>
struct Fmt;

template <>
struct Fmt<__nv_bfloat16> {
  static constexpr uint32_t MAGIC = 0x43004300u;  // 128.0, twice
  using Pair = __nv_bfloat162;
};

template <>
struct Fmt<__half> {
  static constexpr uint32_t MAGIC = 0x64006400u;  // 1024.0, twice
  using Pair = __half2;
};

// a - b on two packed values of T.
template <typename T>
__device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
  using P = typename Fmt<T>::Pair;
  P d = __hsub2(*reinterpret_cast<P*>(&a), *reinterpret_cast<P*>(&b));
  return *reinterpret_cast<uint32_t*>(&d);
}

// d += A (16x16, four registers) * B (16x8, two registers) on the tensor cores, float32 sums.
template <typename T>
__device__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1);

#define EDGE_MMA(TYPE, PTX)                                                                                       \
  template <>                                                                                                     \
  __device__ __forceinline__ void mma<TYPE>(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,    \
                                            uint32_t b0, uint32_t b1) {                                           \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "         \
        "{%0,%1,%2,%3};"                                                                                          \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                          \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                                                  \
  }
EDGE_MMA(__nv_bfloat16, "bf16")
EDGE_MMA(__half, "f16")
#undef EDGE_MMA

// Streamed once per token and never reused before it is evicted: keep it out of L1.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float v) {
  return __float2bfloat16(v);
}
template <>
__device__ __forceinline__ __half from_float(float v) {
  return __float2half(v);
}
template <>
__device__ __forceinline__ float from_float(float v) {
  return v;
}

// UNROLL: chunks (16 bytes a lane) a warp loads before it uses the first, so that enough
// bytes are in flight to cover the memory's latency; tuned per shape with WARPS.
template <typename T, int G, int WARPS, int UNROLL>
__global__ void __launch_bounds__(WARPS * 32)
    gemv_kernel(const uint4* __restrict__ codes, const __half* __restrict__ scales,
                const uint8_t* __restrict__ zeros, const T* __restrict__ x, float* __restrict__ out,
                T* __restrict__ act, int M, int N, int K) {
  const int tile = blockIdx.x;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int chunks = K >> 6;
  const int groups = K / G;
  const uint4* wp = codes + (size_t)tile * chunks * 32 + lane;
  const __half* sp = scales + (size_t)tile * groups * 16;
  const uint8_t* zp = zeros + (size_t)tile * groups * 16;
  // This lane's column of the product is activation row g: rows past M are zeros.
  const bool live = g < M;
  const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)(live ? g : 0) * K) + t;
  // Each warp takes a contiguous run of chunks (neighbouring warps read neighbouring
  // 512-byte pieces of the tile's stream).
  const int per = (chunks + WARPS - 1) / WARPS;
  const int c_begin = warp * per;
  const int c_end = min(chunks, c_begin + per);
  // Groups of 32 change at every sub-chunk; larger ones hold a whole chunk.
  constexpr int SUBS = G == 32 ? 2 : 1;
  float total[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c0 = c_begin; c0 < c_end; c0 += UNROLL) {
    // Everything the round needs from memory is asked for first: the weights and their
    // groups' scales and zero points (loading those where they are used would add a
    // second round trip to every group). The activations (a few KB, in L1 after the
    // first warp on this multiprocessor read them) are loaded where they are used.
    uint4 w[UNROLL];
    __half s_raw[UNROLL][SUBS][2];
    uint8_t z_raw[UNROLL][SUBS][2];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c0 + u;
      const bool in = c < c_end;
      w[u] = in ? load_stream(wp + (size_t)c * 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int h = 0; h < SUBS; ++h) {
        const int grp = in ? (c * 64 + h * 32) / G : 0;
        s_raw[u][h][0] = sp[grp * 16 + g];
        s_raw[u][h][1] = sp[grp * 16 + g + 8];
        z_raw[u][h][0] = zp[grp * 16 + g];
        z_raw[u][h][1] = zp[grp * 16 + g + 8];
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c0 + u;
      if (c >= c_end) break;
      uint4 xv[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
      if (live) {
        xv[0] = __ldg(xp + c * 8);
        xv[1] = __ldg(xp + c * 8 + 4);
      }
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int sub = SUBS == 2 ? h : 0;
        const uint32_t z_lo = Fmt<T>::MAGIC | (uint32_t(z_raw[u][sub][0]) * 0x10001u);
        const uint32_t z_hi = Fmt<T>::MAGIC | (uint32_t(z_raw[u][sub][1]) * 0x10001u);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const uint32_t v = word_of(w[u], h * 2 + i);
          const uint32_t a0 = sub2<T>((v & 0x000F000Fu) | Fmt<T>::MAGIC, z_lo);
          const uint32_t a1 = sub2<T>(((v >> 4) & 0x000F000Fu) | Fmt<T>::MAGIC, z_hi);
          const uint32_t a2 = sub2<T>(((v >> 8) & 0x000F000Fu) | Fmt<T>::MAGIC, z_lo);
          const uint32_t a3 = sub2<T>(((v >> 12) & 0x000F000Fu) | Fmt<T>::MAGIC, z_hi);
          mma<T>(acc, a0, a1, a2, a3, word_of(xv[h], 2 * i), word_of(xv[h], 2 * i + 1));
        }
        if (SUBS == 2 || h == 1) {  // the group's (or the chunk's) sums, scaled once
          const float s_lo = __half2float(s_raw[u][sub][0]);
          const float s_hi = __half2float(s_raw[u][sub][1]);
          total[0] += s_lo * acc[0];
          total[1] += s_lo * acc[1];
          total[2] += s_hi * acc[2];
          total[3] += s_hi * acc[3];
          acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
        }
      }
    }
  }
  // The warps' sums, added in warp order (the same order at every launch).
  __shared__ float red[WARPS][32][4];
  if (WARPS > 1) {
#pragma unroll
    for (int j = 0; j < 4; ++j) red[warp][lane][j] = total[j];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float s = red[0][lane][j];
      for (int o = 1; o < WARPS; ++o) s += red[o][lane][j];
      total[j] = s;
    }
  }
  const int b0 = 2 * t;
  const int b1 = b0 + 1;
  if (act != nullptr) {
    // A gated unit's paired weight (repack with paired halves): row g of each tile is
    // gate j = tile*8 + g and row g+8 is up j, so this lane holds both, and writes
    // silu(gate) * up for its two columns (no float32 gate/up round trip, no kernel).
    const int f = N >> 1;
    const int j = tile * 8 + g;
    if (b0 < M) act[(size_t)b0 * f + j] = from_float<T>(total[0] / (1.f + __expf(-total[0])) * total[2]);
    if (b1 < M) act[(size_t)b1 * f + j] = from_float<T>(total[1] / (1.f + __expf(-total[1])) * total[3]);
    return;
  }
  const int row_lo = tile * 16 + g;
  const int row_hi = row_lo + 8;
  if (b0 < M) {
    if (row_lo < N) out[(size_t)b0 * N + row_lo] = total[0];
    if (row_hi < N) out[(size_t)b0 * N + row_hi] = total[2];
  }
  if (b1 < M) {
    if (row_lo < N) out[(size_t)b1 * N + row_lo] = total[1];
    if (row_hi < N) out[(size_t)b1 * N + row_hi] = total[3];
  }
}

// Weights [rows, K] in T, rows from tile `tile0` on, as (code - zero) * scale in float32
// rounded once: what prefill multiplies with the library's matrix product. One thread
// per lane-chunk; it writes four runs of 8 consecutive k.
template <typename T>
__global__ void dequant_kernel(const uint4* __restrict__ codes, const __half* __restrict__ scales,
                               const uint8_t* __restrict__ zeros, T* __restrict__ out, int tile0, int tiles, int N,
                               int K, int G) {
  const int chunks = K >> 6;
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)tiles * chunks * 32) return;
  const int lane = int(idx & 31);
  const int c = int((idx >> 5) % chunks);
  const int tile = tile0 + int((idx >> 5) / chunks);
  const int g = lane >> 2;
  const int t = lane & 3;
  const int groups = K / G;
  const uint4 v = codes[((size_t)tile * chunks + c) * 32 + lane];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int row = tile * 16 + rh * 8 + g;
    if (row >= N) continue;
    T* dst = out + (size_t)(row - tile0 * 16) * K;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k0 = c * 64 + h * 32 + t * 8;
      const int grp = k0 / G;
      const float s = __half2float(scales[((size_t)tile * groups + grp) * 16 + rh * 8 + g]);
      const float z = float(zeros[((size_t)tile * groups + grp) * 16 + rh * 8 + g]);
      // The run's 8 values (k0 + i*4 + r*2 + e), then one store of them.
      alignas(16) T vals[8];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint32_t word = word_of(v, h * 2 + i);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const uint32_t code = (word >> (4 * (e * 4 + r * 2 + rh))) & 15u;
            vals[i * 4 + r * 2 + e] = from_float<T>((float(code) - z) * s);
          }
        }
      }
      uint4* to = reinterpret_cast<uint4*>(dst + k0);
#pragma unroll
      for (int q = 0; q < int(sizeof(vals) / 16); ++q) to[q] = reinterpret_cast<const uint4*>(vals)[q];
    }
  }
}

template <typename T, int G, int U>
cudaError_t launch_gemv(const void* codes, const void* scales, const void* zeros, const void* x, void* out, void* act,
                        int M, int N, int K, int warps, cudaStream_t stream) {
  T* a = static_cast<T*>(act);
  const dim3 grid((N + 15) / 16);
  const uint4* c = static_cast<const uint4*>(codes);
  const __half* s = static_cast<const __half*>(scales);
  const uint8_t* z = static_cast<const uint8_t*>(zeros);
  const T* xx = static_cast<const T*>(x);
  float* o = static_cast<float*>(out);
  switch (warps) {
    case 1: gemv_kernel<T, G, 1, U><<<grid, 32, 0, stream>>>(c, s, z, xx, o, a, M, N, K); break;
    case 2: gemv_kernel<T, G, 2, U><<<grid, 64, 0, stream>>>(c, s, z, xx, o, a, M, N, K); break;
    case 4: gemv_kernel<T, G, 4, U><<<grid, 128, 0, stream>>>(c, s, z, xx, o, a, M, N, K); break;
    case 8: gemv_kernel<T, G, 8, U><<<grid, 256, 0, stream>>>(c, s, z, xx, o, a, M, N, K); break;
    case 16: gemv_kernel<T, G, 16, U><<<grid, 512, 0, stream>>>(c, s, z, xx, o, a, M, N, K); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T, int G>
cudaError_t launch_unrolled(const void* codes, const void* scales, const void* zeros, const void* x, void* out,
                            void* act, int M, int N, int K, int warps, int unroll, cudaStream_t stream) {
  switch (unroll) {
    case 2: return launch_gemv<T, G, 2>(codes, scales, zeros, x, out, act, M, N, K, warps, stream);
    case 4: return launch_gemv<T, G, 4>(codes, scales, zeros, x, out, act, M, N, K, warps, stream);
    case 8: return launch_gemv<T, G, 8>(codes, scales, zeros, x, out, act, M, N, K, warps, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t gemv_for_group(const void* codes, const void* scales, const void* zeros, const void* x, void* out,
                           void* act, int M, int N, int K, int G, int warps, int unroll, cudaStream_t stream) {
  switch (G) {
    case 32: return launch_unrolled<T, 32>(codes, scales, zeros, x, out, act, M, N, K, warps, unroll, stream);
    case 64: return launch_unrolled<T, 64>(codes, scales, zeros, x, out, act, M, N, K, warps, unroll, stream);
    case 128: return launch_unrolled<T, 128>(codes, scales, zeros, x, out, act, M, N, K, warps, unroll, stream);
    case 256: return launch_unrolled<T, 256>(codes, scales, zeros, x, out, act, M, N, K, warps, unroll, stream);
    default: return cudaErrorInvalidValue;
  }
}

// Asks L2 for [p, p + bytes) ahead of the kernel that reads it: the decode step runs it
// on a side stream while latency-bound kernels (attention, norms) leave the memory idle,
// so the next small product finds its weight in L2. One 128-byte line per prefetch.
__global__ void l2_prefetch_kernel(const char* __restrict__ p, long long lines) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long line = (long long)blockIdx.x * blockDim.x + threadIdx.x; line < lines; line += stride) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + line * 128));
  }
}

}  // namespace

extern "C" {

int edge_l2_prefetch(const void* p, long long bytes, void* stream) {
  const long long lines = (bytes + 127) / 128;
  if (lines <= 0) return 0;
  const int block = 256;
  const long long blocks = (lines + block - 1) / block;
  l2_prefetch_kernel<<<unsigned(blocks < 1024 ? blocks : 1024), block, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const char*>(p), lines);
  return int(cudaGetLastError());
}

// dtype: 0 bfloat16, 1 float16 activations; warps 1..16 per tile; unroll 2, 4 or 8.
// out [M, N] float32, or, where `act` is given (a paired gate/up weight, N = 2F rows),
// act [M, F] in the activations' type: silu(gate) * up. Returns a cudaError_t (0: launched).
int edge_int4_gemv(const void* codes, const void* scales, const void* zeros, const void* x, void* out, void* act, int M,
                   int N, int K, int G, int dtype, int warps, int unroll, void* stream) {
  if (M < 1 || M > 8 || K % 64 != 0 || G % 32 != 0 || K % G != 0) return int(cudaErrorInvalidValue);
  if (act != nullptr && N % 16 != 0) return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 0)
    return int(gemv_for_group<__nv_bfloat16>(codes, scales, zeros, x, out, act, M, N, K, G, warps, unroll, s));
  if (dtype == 1) return int(gemv_for_group<__half>(codes, scales, zeros, x, out, act, M, N, K, G, warps, unroll, s));
  return int(cudaErrorInvalidValue);
}

// dtype: 0 bfloat16, 1 float16, 2 float32 output.
int edge_int4_dequant(const void* codes, const void* scales, const void* zeros, void* out, int tile0, int tiles, int N,
                      int K, int G, int dtype, void* stream) {
  if (K % 64 != 0 || G % 32 != 0 || K % G != 0 || tiles < 1) return int(cudaErrorInvalidValue);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const long long threads = (long long)tiles * (K / 64) * 32;
  const int block = 256;
  const dim3 grid(unsigned((threads + block - 1) / block));
  const uint4* c = static_cast<const uint4*>(codes);
  const __half* sc = static_cast<const __half*>(scales);
  const uint8_t* z = static_cast<const uint8_t*>(zeros);
  if (dtype == 0) {
    dequant_kernel<__nv_bfloat16><<<grid, block, 0, s>>>(c, sc, z, static_cast<__nv_bfloat16*>(out), tile0, tiles, N,
                                                         K, G);
  } else if (dtype == 1) {
    dequant_kernel<__half><<<grid, block, 0, s>>>(c, sc, z, static_cast<__half*>(out), tile0, tiles, N, K, G);
  } else if (dtype == 2) {
    dequant_kernel<float><<<grid, block, 0, s>>>(c, sc, z, static_cast<float*>(out), tile0, tiles, N, K, G);
  } else {
    return int(cudaErrorInvalidValue);
  }
  return int(cudaGetLastError());
}

}  // extern "C"
