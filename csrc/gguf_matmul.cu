// y = x W^T with W kept as a GGUF file stores it, dequantized inside the dot product (issue 58:
// the GPU's routine of minipaged/models/gguf_linear.py; csrc/cpu/gguf_linear.cpp and
// csrc/cpu/gguf_kquants.cpp are the CPU's).
//
// W is [out_features] rows of blocks (minipaged/kernels/gguf_blocks.py has the table):
//   Q8_0  (34 bytes, 32 weights)   d f16 | 32 int8 q                     w = d * q
//   Q4_1  (20 bytes, 32 weights)   d, m f16 | 16 bytes: weight i < 16 the low nibble of byte i,
//                                  weight i >= 16 the high nibble of byte i - 16   w = d * q + m
//   Q5_0  (22 bytes, 32 weights)   d f16 | 4 bytes: bit i = weight i's fifth bit | 16 bytes of
//                                  nibbles as Q4_1's                      w = d * (q - 16)
//   Q4_K  (144 bytes, 256 weights) d, dmin f16 | 12 bytes: 8 scales sc and 8 mins mn, 6 bits
//                                  each | 128 bytes: the 32 bytes of group g hold sub-block 2g
//                                  (low nibbles) and 2g + 1 (high)   w = (d * sc) * q - dmin * mn
//   Q6_K  (210 bytes, 256 weights) 128 bytes of low 4 bits | 64 bytes of high 2 bits | 16 int8
//                                  scales (one per 16 weights) | d f16   w = (d * sc) * (q - 32)
//
// The work: one warp per weight row (WARPS rows per CUDA block), ROWS rows of x at a time. A
// row's weights are cut into slices of 8 (a quarter of a 32-weight block, a 32nd of a K block);
// lane l dequantizes slices l, l + 32, ... and multiplies each weight with the ROWS inputs it
// meets, so a block's bytes are read once per ROWS rows of x, never written out as floats. The
// lanes' partial sums are then added by a butterfly of __shfl_xor_sync (masks 16, 8, 4, 2, 1)
// and lane 0 writes the ROWS outputs. x and y are float32, float16 or bfloat16; the sums are
// float32, rounded to y's dtype once.
//
// Each weight is computed with the operations, order and roundings of the `gguf` package's
// dequantization (__fmul_rn and __fadd_rn: never fused into an fma), so a one-hot row of x gives
// back a row of the dequantized weights bit for bit (tests/kernels/test_gguf_matmul.py); any
// other x agrees with F.linear on the dequantized weights up to float rounding (another order
// of the sums).

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>

#include "kernels.h"     // the extern "C" declarations: the compiler checks they match
#include "kv_quant.cuh"  // to_float, from_float

namespace minipaged {
namespace gguf {

constexpr int WARP = 32;
constexpr int WARPS = 4;        // weight rows (warps) per CUDA block
constexpr int ROWS = 4;         // rows of x a warp takes at once
constexpr int SLICE = 8;        // weights a lane dequantizes at once
constexpr int MAX_GRID_Y = 65535;
// error codes beside minipaged::ErrorCode's (paged_attention_plan.cuh ends at -13)
constexpr int UNSUPPORTED_FORMAT = -14;
constexpr int BAD_IN_FEATURES = -15;  // not a whole number of the format's blocks

__device__ __forceinline__ float half_at(const uint8_t* p) {
  return to_float(*reinterpret_cast<const __half*>(p));
}
__device__ __forceinline__ float scaled(float d, float q) { return __fmul_rn(d, q); }

// Each format: its ggml number, weights and bytes per block, and `slice(block, s, w)`: weights
// SLICE * s .. SLICE * s + 7 of a block as float32.
struct Q8_0 {
  static constexpr int TYPE = 8, WEIGHTS = 32, BYTES = 34;
  __device__ static void slice(const uint8_t* b, int s, float w[SLICE]) {
    const float d = half_at(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2) + SLICE * s;
#pragma unroll
    for (int j = 0; j < SLICE; ++j) w[j] = scaled((float)q[j], d);
  }
};

struct Q4_1 {
  static constexpr int TYPE = 3, WEIGHTS = 32, BYTES = 20;
  __device__ static void slice(const uint8_t* b, int s, float w[SLICE]) {
    const float d = half_at(b), m = half_at(b + 2);
    const uint8_t* q = b + 4 + SLICE * (s % 2);  // slices 0, 1: low nibbles; 2, 3: high
    const int shift = s < 2 ? 0 : 4;
#pragma unroll
    for (int j = 0; j < SLICE; ++j) w[j] = __fadd_rn(scaled(d, (float)((q[j] >> shift) & 15)), m);
  }
};

struct Q5_0 {
  static constexpr int TYPE = 6, WEIGHTS = 32, BYTES = 22;
  __device__ static void slice(const uint8_t* b, int s, float w[SLICE]) {
    const float d = half_at(b);
    const uint8_t fifth = b[2 + s];  // the fifth bits of weights 8s .. 8s + 7
    const uint8_t* q = b + 6 + SLICE * (s % 2);
    const int shift = s < 2 ? 0 : 4;
#pragma unroll
    for (int j = 0; j < SLICE; ++j) {
      const int code = ((q[j] >> shift) & 15) | (((fifth >> j) & 1) << 4);
      w[j] = scaled(d, (float)(code - 16));
    }
  }
};

struct Q4_K {
  static constexpr int TYPE = 12, WEIGHTS = 256, BYTES = 144;
  __device__ static void slice(const uint8_t* b, int s, float w[SLICE]) {
    const int sub = s / 4;  // the sub-block of 32 weights
    const uint8_t* p = b + 4;  // the 12 bytes of scales and mins
    int sc, mn;
    if (sub < 4) {
      sc = p[sub] & 63;
      mn = p[sub + 4] & 63;
    } else {
      sc = (p[sub + 4] & 15) | ((p[sub - 4] >> 6) << 4);
      mn = (p[sub + 4] >> 4) | ((p[sub] >> 6) << 4);
    }
    const float d = scaled(half_at(b), (float)sc), dm = scaled(half_at(b + 2), (float)mn);
    const uint8_t* q = b + 16 + 32 * (sub / 2) + SLICE * (s % 4);
    const int shift = sub % 2 ? 4 : 0;
#pragma unroll
    for (int j = 0; j < SLICE; ++j) w[j] = __fadd_rn(scaled(d, (float)((q[j] >> shift) & 15)), -dm);
  }
};

struct Q6_K {
  static constexpr int TYPE = 14, WEIGHTS = 256, BYTES = 210;
  __device__ static void slice(const uint8_t* b, int s, float w[SLICE]) {
    const int half = s / 16, group = (s % 16) / 4, i = SLICE * (s % 4);  // i: within the group
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);  // one per 16 weights
    const float d = scaled(half_at(b + 208), (float)scales[s / 2]);
    const uint8_t* low = b + 64 * half + 32 * (group % 2) + i;
    const uint8_t* high = b + 128 + 32 * half + i;
    const int shift = group < 2 ? 0 : 4;
#pragma unroll
    for (int j = 0; j < SLICE; ++j) {
      const int code = ((low[j] >> shift) & 15) | (((high[j] >> (2 * group)) & 3) << 4);
      w[j] = scaled(d, (float)(code - 32));
    }
  }
};

// out [rows, out_features] (contiguous) = x [rows, in_features] (rows x_stride apart) W^T.
template <typename F, typename T>
__global__ void __launch_bounds__(WARPS * WARP) gguf_matmul_kernel(
    T* __restrict__ out, const T* __restrict__ x, const uint8_t* __restrict__ weight, int rows,
    int out_features, int in_features, int64_t x_stride) {
  const int lane = threadIdx.x % WARP;
  const int n = blockIdx.x * WARPS + threadIdx.x / WARP;  // this warp's weight row
  if (n >= out_features) return;  // (the whole warp: its shuffles below stay full)
  constexpr int PER_BLOCK = F::WEIGHTS / SLICE;  // slices per block
  const uint8_t* row = weight + (int64_t)n * (in_features / F::WEIGHTS) * F::BYTES;
  const int slices = in_features / SLICE;
  for (int r0 = blockIdx.y * ROWS; r0 < rows; r0 += gridDim.y * ROWS) {
    const int count = rows - r0 < ROWS ? rows - r0 : ROWS;
    float acc[ROWS] = {};
    for (int s = lane; s < slices; s += WARP) {
      float w[SLICE];
      F::slice(row + (int64_t)(s / PER_BLOCK) * F::BYTES, s % PER_BLOCK, w);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        if (r >= count) break;
        const T* xs = x + (int64_t)(r0 + r) * x_stride + SLICE * s;
#pragma unroll
        for (int j = 0; j < SLICE; ++j) acc[r] += w[j] * to_float(xs[j]);
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {  // the butterfly: every lane ends with the warp's sum
      for (int mask = WARP / 2; mask > 0; mask /= 2) {
        acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], mask);
      }
    }
    if (lane == 0) {
      for (int r = 0; r < count; ++r) {
        out[(int64_t)(r0 + r) * out_features + n] = from_float<T>(acc[r]);
      }
    }
  }
}

template <typename T>
int launch(void* out, const void* x, const void* weight, int ggml_type, int rows,
           int out_features, int in_features, int64_t x_stride, cudaStream_t stream) {
  auto run = [&](auto format) {
    using F = decltype(format);
    if (in_features % F::WEIGHTS != 0) return BAD_IN_FEATURES;
    const int chunks = (rows + ROWS - 1) / ROWS;
    const dim3 grid((out_features + WARPS - 1) / WARPS, chunks < MAX_GRID_Y ? chunks : MAX_GRID_Y);
    gguf_matmul_kernel<F, T><<<grid, WARPS * WARP, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(x), static_cast<const uint8_t*>(weight),
        rows, out_features, in_features, x_stride);
    return (int)cudaGetLastError();
  };
  switch (ggml_type) {
    case Q8_0::TYPE: return run(Q8_0());
    case Q4_1::TYPE: return run(Q4_1());
    case Q5_0::TYPE: return run(Q5_0());
    case Q4_K::TYPE: return run(Q4_K());
    case Q6_K::TYPE: return run(Q6_K());
    default: return UNSUPPORTED_FORMAT;
  }
}

}  // namespace gguf
}  // namespace minipaged

extern "C" int minipaged_gguf_linear(void* out, const void* x, const void* weight, int ggml_type,
                                     int rows, int out_features, int in_features,
                                     int64_t x_stride, int dtype, cudaStream_t stream) {
  using namespace minipaged::gguf;
  if (rows == 0 || out_features == 0) return 0;
  (void)cudaGetLastError();  // an earlier call's error was that call's to report
  switch (dtype) {
    case 0: return launch<float>(out, x, weight, ggml_type, rows, out_features, in_features,
                                 x_stride, stream);
    case 1: return launch<__half>(out, x, weight, ggml_type, rows, out_features, in_features,
                                  x_stride, stream);
    case 2: return launch<__nv_bfloat16>(out, x, weight, ggml_type, rows, out_features,
                                         in_features, x_stride, stream);
    default: return -1;
  }
}
