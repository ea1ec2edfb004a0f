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
//
// The RMSNorm between a layer's products is folded into them (Norm below). A producer (the
// o and down products) adds its sums into the float32 residual in place and writes
// resid * norm weight, not yet divided by its RMS, with each tile's sum of squares of the
// residual. A consumer (q/k/v, gate/up, the head) multiplies its sums per row by
// rsqrt(mean square + eps) from those partial sums: the norm's division moved past the
// product, which is linear in it, so no norm kernel runs between the two. The partial sums
// are written per tile and added in a fixed order: no atomics, no zeroing, the same bits at
// every launch and whatever the batch.

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

// 16 bytes from global into shared memory without holding registers: issued at the start,
// waited for at the end, so the copy hides under the weight stream.
__device__ __forceinline__ void copy_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void copy_async_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// The folded RMSNorm (see the header); a null pointer turns its half off.
struct Norm {
  // Consumer: x is resid * w of a producer; parts [M][K/16] its tiles' sums of squares.
  const float* parts;
  float eps;
  // Producer: resid [M][N] float32 += the product; normed [M][N] = resid * norm_w in T;
  // part_out [M][N/16] each tile's sum of squares of the new resid.
  float* resid;
  const void* norm_w;
  void* normed;
  float* part_out;
};

// UNROLL: chunks (16 bytes a lane) a warp loads before it uses the first, so that enough
// bytes are in flight to cover the memory's latency; tuned per shape with WARPS.
// MODE: what the folded RMSNorm asks of this launch (a template parameter, so the plain
// product compiles to the code it has without the fold: no registers held for it).
enum Mode { PLAIN = 0, CONSUMER = 1, PRODUCER = 2 };

template <typename T, int G, int WARPS, int UNROLL, int MODE>
__global__ void __launch_bounds__(WARPS * 32)
    gemv_kernel(const uint4* __restrict__ codes, const __half* __restrict__ scales,
                const uint8_t* __restrict__ zeros, const T* __restrict__ x, float* __restrict__ out,
                T* __restrict__ act, int M, int N, int K, const Norm norm) {
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
  const int b0 = 2 * t;  // the two activation rows (product columns) this lane ends with
  const int b1 = b0 + 1;
  const int row_lo = tile * 16 + g;
  const int row_hi = row_lo + 8;
  // What the fold needs at the end comes into shared memory meanwhile, with no register
  // held through the loop: a consumer's partial sums of squares [M][K/16]; a producer's
  // residual at its 16 rows [M][16] and their norm weights [16].
  extern __shared__ float4 fold_smem[];
  const int parts_per_row = K >> 4;
  if (MODE == CONSUMER) {
    const float4* src = reinterpret_cast<const float4*>(norm.parts);
    for (int i = threadIdx.x; i < (M * parts_per_row) >> 2; i += WARPS * 32) copy_async16(fold_smem + i, src + i);
    copy_async_commit();
  }
  if (MODE == PRODUCER) {
    for (int i = threadIdx.x; i < 4 * M + 2; i += WARPS * 32) {
      if (i < 4 * M) {  // row b's 16 residuals: four 16-byte pieces
        copy_async16(fold_smem + i, norm.resid + (size_t)(i >> 2) * N + tile * 16 + (i & 3) * 4);
      } else {  // the 16 norm weights (2 bytes each): two pieces
        copy_async16(fold_smem + i, static_cast<const T*>(norm.norm_w) + tile * 16 + (i - 4 * M) * 8);
      }
    }
    copy_async_commit();
  }
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
  if (MODE != PLAIN) copy_async_wait();
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
  } else if (MODE != PLAIN) {
    __syncthreads();  // the other lanes' copies
  }
  if (MODE == CONSUMER) {
    // Row b's 1/RMS from the producer's K/16 partial sums: lane l adds l, l+32, ..., then
    // a butterfly (every lane ends with the same bits).
    const float* ps = reinterpret_cast<const float*>(fold_smem);
    float inv0 = 0.f, inv1 = 0.f;
    for (int b = 0; b < M; ++b) {
      float s = 0.f;
      for (int p = lane; p < parts_per_row; p += 32) s += ps[b * parts_per_row + p];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      const float inv = rsqrtf(s / float(K) + norm.eps);
      inv0 = b == b0 ? inv : inv0;
      inv1 = b == b1 ? inv : inv1;
    }
    total[0] *= inv0;
    total[1] *= inv1;
    total[2] *= inv0;
    total[3] *= inv1;
  }
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
  if (MODE == PRODUCER) {
    // Producer (N a multiple of 16: every row is real): the new residual, the next
    // norm's input, and this tile's sums of squares (the 8 lanes of one t hold its 16 rows).
    T* normed = static_cast<T*>(norm.normed);
    const float* r_in = reinterpret_cast<const float*>(fold_smem);  // [M][16]
    const T* w_in = reinterpret_cast<const T*>(fold_smem + 4 * M);
    const float w_lo = float(w_in[g]), w_hi = float(w_in[g + 8]);
    // Activation row b at this lane's two rows: stores, and returns their sum of squares.
    auto add_rows = [&](int b, float sum_lo, float sum_hi) {
      if (b >= M) return 0.f;
      const float lo = r_in[b * 16 + g] + sum_lo, hi = r_in[b * 16 + g + 8] + sum_hi;
      norm.resid[(size_t)b * N + row_lo] = lo;
      norm.resid[(size_t)b * N + row_hi] = hi;
      normed[(size_t)b * N + row_lo] = from_float<T>(lo * w_lo);
      normed[(size_t)b * N + row_hi] = from_float<T>(hi * w_hi);
      return lo * lo + hi * hi;
    };
    float sq0 = add_rows(b0, total[0], total[2]);
    float sq1 = add_rows(b1, total[1], total[3]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      sq0 += __shfl_xor_sync(0xffffffffu, sq0, o);
      sq1 += __shfl_xor_sync(0xffffffffu, sq1, o);
    }
    const int tiles = N >> 4;
    if (g == 0) {
      if (b0 < M) norm.part_out[(size_t)b0 * tiles + tile] = sq0;
      if (b1 < M) norm.part_out[(size_t)b1 * tiles + tile] = sq1;
    }
    return;
  }
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

template <typename T, int G, int U, int MODE>
cudaError_t launch_mode(const void* codes, const void* scales, const void* zeros, const void* x, void* out, void* act,
                        int M, int N, int K, const Norm& norm, int warps, cudaStream_t stream) {
  T* a = static_cast<T*>(act);
  const dim3 grid((N + 15) / 16);
  const uint4* c = static_cast<const uint4*>(codes);
  const __half* s = static_cast<const __half*>(scales);
  const uint8_t* z = static_cast<const uint8_t*>(zeros);
  const T* xx = static_cast<const T*>(x);
  float* o = static_cast<float*>(out);
  const size_t smem = MODE == CONSUMER   ? size_t(M) * (K / 16) * sizeof(float)
                      : MODE == PRODUCER ? size_t(M) * 16 * sizeof(float) + 16 * sizeof(T)
                                         : 0;
  switch (warps) {
    case 1: gemv_kernel<T, G, 1, U, MODE><<<grid, 32, smem, stream>>>(c, s, z, xx, o, a, M, N, K, norm); break;
    case 2: gemv_kernel<T, G, 2, U, MODE><<<grid, 64, smem, stream>>>(c, s, z, xx, o, a, M, N, K, norm); break;
    case 4: gemv_kernel<T, G, 4, U, MODE><<<grid, 128, smem, stream>>>(c, s, z, xx, o, a, M, N, K, norm); break;
    case 8: gemv_kernel<T, G, 8, U, MODE><<<grid, 256, smem, stream>>>(c, s, z, xx, o, a, M, N, K, norm); break;
    case 16: gemv_kernel<T, G, 16, U, MODE><<<grid, 512, smem, stream>>>(c, s, z, xx, o, a, M, N, K, norm); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T, int G, int U>
cudaError_t launch_gemv(const void* codes, const void* scales, const void* zeros, const void* x, void* out, void* act,
                        int M, int N, int K, const Norm& norm, int warps, cudaStream_t stream) {
  if (norm.resid != nullptr)
    return launch_mode<T, G, U, PRODUCER>(codes, scales, zeros, x, out, act, M, N, K, norm, warps, stream);
  if (norm.parts != nullptr)
    return launch_mode<T, G, U, CONSUMER>(codes, scales, zeros, x, out, act, M, N, K, norm, warps, stream);
  return launch_mode<T, G, U, PLAIN>(codes, scales, zeros, x, out, act, M, N, K, norm, warps, stream);
}

template <typename T, int G>
cudaError_t launch_unrolled(const void* codes, const void* scales, const void* zeros, const void* x, void* out,
                            void* act, int M, int N, int K, const Norm& norm, int warps, int unroll,
                            cudaStream_t stream) {
  switch (unroll) {
    case 2: return launch_gemv<T, G, 2>(codes, scales, zeros, x, out, act, M, N, K, norm, warps, stream);
    case 4: return launch_gemv<T, G, 4>(codes, scales, zeros, x, out, act, M, N, K, norm, warps, stream);
    case 8: return launch_gemv<T, G, 8>(codes, scales, zeros, x, out, act, M, N, K, norm, warps, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t gemv_for_group(const void* codes, const void* scales, const void* zeros, const void* x, void* out,
                           void* act, int M, int N, int K, int G, const Norm& norm, int warps, int unroll,
                           cudaStream_t stream) {
  switch (G) {
    case 32: return launch_unrolled<T, 32>(codes, scales, zeros, x, out, act, M, N, K, norm, warps, unroll, stream);
    case 64: return launch_unrolled<T, 64>(codes, scales, zeros, x, out, act, M, N, K, norm, warps, unroll, stream);
    case 128: return launch_unrolled<T, 128>(codes, scales, zeros, x, out, act, M, N, K, norm, warps, unroll, stream);
    case 256: return launch_unrolled<T, 256>(codes, scales, zeros, x, out, act, M, N, K, norm, warps, unroll, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" {

// A consumer's partial sums sit in shared memory: at most this much without opting in to
// more, beside the warps' 8 KB of sums (K up to 16384 at 8 rows).
constexpr size_t MAX_PARTS_BYTES = 32 * 1024;

// dtype: 0 bfloat16, 1 float16 activations; warps 1..16 per tile; unroll 2, 4 or 8.
// out [M, N] float32, or, where `act` is given (a paired gate/up weight, N = 2F rows),
// act [M, F] in the activations' type: silu(gate) * up.
// The folded RMSNorm (the header says how): `parts` [M, K/16] float32 makes this product a
// consumer of x = resid * w with those sums of squares (eps the norm's epsilon); `resid`
// [M, N] float32 with norm_w [N], normed [M, N] and part_out [M, N/16] makes it a producer
// (no out, no act, N a multiple of 16). Pointers are 16-byte aligned. Returns a
// cudaError_t (0: launched).
int edge_int4_gemv(const void* codes, const void* scales, const void* zeros, const void* x, void* out, void* act,
                   const float* parts, float eps, float* resid, const void* norm_w, void* normed, float* part_out,
                   int M, int N, int K, int G, int dtype, int warps, int unroll, void* stream) {
  if (M < 1 || M > 8 || K % 64 != 0 || G % 32 != 0 || K % G != 0) return int(cudaErrorInvalidValue);
  if (act != nullptr && N % 16 != 0) return int(cudaErrorInvalidValue);
  if (parts != nullptr && size_t(M) * (K / 16) * sizeof(float) > MAX_PARTS_BYTES) return int(cudaErrorInvalidValue);
  if (resid != nullptr &&
      (out != nullptr || act != nullptr || N % 16 != 0 || norm_w == nullptr || normed == nullptr || part_out == nullptr))
    return int(cudaErrorInvalidValue);
  if (resid == nullptr && out == nullptr && act == nullptr) return int(cudaErrorInvalidValue);
  const Norm norm{parts, eps, resid, norm_w, normed, part_out};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 0)
    return int(gemv_for_group<__nv_bfloat16>(codes, scales, zeros, x, out, act, M, N, K, G, norm, warps, unroll, s));
  if (dtype == 1)
    return int(gemv_for_group<__half>(codes, scales, zeros, x, out, act, M, N, K, G, norm, warps, unroll, s));
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
