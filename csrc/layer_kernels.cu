// The small operations between a LLaMA layer's matmuls, one kernel each (lesson 15).
//
// In a decode step of 64 sequences each of these touches a few hundred kilobytes, so its time is
// the launch, not the bytes: in torch, RMSNorm was 4 kernels (and 5 with the residual add before
// it), the rotary embedding 12, SiLU-and-multiply 2. At 2-3 us a launch, with 32 layers, that was
// about 2 ms of a 10 ms LLaMA-7B step on an H200 (benchmarks/RESULTS.md). Here:
//
//   rms_norm        out = weight * T(x * rsqrt(mean(x^2) + eps))        one CUDA block per token
//                   with `residual`: x = T(input + residual) is written to `sum_out` first
//                   (the residual stream), then normalised: the add and the norm in one kernel
//   rotary          q and k rotated by their positions (rotate-half layout): one block per token
//   silu_and_mul    out = T(T(silu(gate)) * up)                          elementwise, gate and
//                   up rows at any stride (the halves of one fused matmul's output)
//
// The arithmetic and its roundings are torch's (and transformers'): every product or sum that
// torch rounds to the tensor's dtype T is rounded to T here too, so fp16 and bf16 results match
// the torch reference (minipaged/kernels/reference.py) within two units in the last place: the
// norm's sum of squares is added in another order, which can move a normalised value by one unit
// before the weight multiplies it (tests/kernels/test_layer_kernels.py).
//
// Layouts: rows of `hidden` elements, last dimension contiguous, rows at any stride; q
// [num_tokens, num_heads, head_size] and k [num_tokens, num_kv_heads, head_size] with contiguous
// heads; cos and sin tables [max_position, head_size] in T.

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>

#include "kernels.h"     // the extern "C" declarations: the compiler checks they match
#include "kv_quant.cuh"  // to_float, from_float

namespace minipaged {
namespace layer {

constexpr int WARP = 32;
constexpr int NORM_THREADS = 256;
constexpr int ROTARY_THREADS = 128;
constexpr int ELEMENTWISE_THREADS = 256;

template <typename T> __device__ __forceinline__ T round_to(float v) { return from_float<T>(v); }
// The value a torch op on T tensors produces: computed in float, rounded to T.
template <typename T> __device__ __forceinline__ float in_t(float v) {
  return to_float(round_to<T>(v));
}

// The sum of `v` over the CUDA block: butterflies within each warp, then the warps' sums
// through shared memory (every thread gets the total).
template <int NUM_THREADS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP;
  for (int mask = WARP / 2; mask > 0; mask /= 2) v += __shfl_xor_sync(0xffffffffu, v, mask);
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < NUM_WARPS ? scratch[lane] : 0.f;
  for (int mask = WARP / 2; mask > 0; mask /= 2) v += __shfl_xor_sync(0xffffffffu, v, mask);
  return v;
}

template <typename T, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) rms_norm_kernel(
    T* __restrict__ out, const T* __restrict__ input, const T* __restrict__ residual,
    T* __restrict__ sum_out, const T* __restrict__ weight, float eps, int hidden,
    int64_t out_stride, int64_t input_stride, int64_t residual_stride, int64_t sum_stride) {
  __shared__ float scratch[NUM_THREADS / WARP];
  const int64_t token = blockIdx.x;
  const T* x = input + token * input_stride;
  float squares = 0.f;
  // Pass 1: each thread squares its own elements (and, with a residual, writes their sums).
  for (int i = threadIdx.x; i < hidden; i += NUM_THREADS) {
    float v = to_float(x[i]);
    if (residual != nullptr) {
      const T sum = round_to<T>(v + to_float(residual[token * residual_stride + i]));
      sum_out[token * sum_stride + i] = sum;
      v = to_float(sum);
    }
    squares += v * v;
  }
  const float inv_rms = 1.f / sqrtf(block_sum<NUM_THREADS>(squares, scratch) / hidden + eps);
  // Pass 2: the same elements (a thread reads back only what it wrote itself).
  const T* source = residual != nullptr ? sum_out + token * sum_stride : x;
  for (int i = threadIdx.x; i < hidden; i += NUM_THREADS) {
    const float normed = in_t<T>(to_float(source[i]) * inv_rms);
    out[token * out_stride + i] = round_to<T>(to_float(weight[i]) * normed);
  }
}

// Rotate-half RoPE of one head's vector: for i < half, with c = cos[pos], s = sin[pos],
//   out[i]        = x[i] * c[i]               - x[i + half] * s[i]
//   out[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half]
// rounded as torch computes x * cos + rotate_half(x) * sin.
template <typename T>
__device__ __forceinline__ void rotate_pair(const T* x, T* out, const T* c, const T* s, int i,
                                            int half) {
  const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
  out[i] = round_to<T>(in_t<T>(x1 * to_float(c[i])) + in_t<T>(-x2 * to_float(s[i])));
  out[i + half] = round_to<T>(in_t<T>(x2 * to_float(c[i + half])) +
                              in_t<T>(x1 * to_float(s[i + half])));
}

template <typename T, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) rotary_kernel(
    T* __restrict__ q_out, T* __restrict__ k_out, const T* __restrict__ q,
    const T* __restrict__ k, const int64_t* __restrict__ positions, const T* __restrict__ cos,
    const T* __restrict__ sin, int num_heads, int num_kv_heads, int head_size,
    int64_t q_stride, int64_t k_stride, int64_t q_out_stride, int64_t k_out_stride) {
  const int64_t token = blockIdx.x;
  const int64_t pos = positions[token];
  const T* c = cos + pos * head_size;
  const T* s = sin + pos * head_size;
  const int half = head_size / 2;
  // Thread j takes pair j % half of head j / half, over the query heads, then the key heads.
  for (int j = threadIdx.x; j < (num_heads + num_kv_heads) * half; j += NUM_THREADS) {
    const int head = j / half, i = j % half;
    if (head < num_heads) {
      rotate_pair(q + token * q_stride + (int64_t)head * head_size,
                  q_out + token * q_out_stride + (int64_t)head * head_size, c, s, i, half);
    } else {
      const int kv = head - num_heads;
      rotate_pair(k + token * k_stride + (int64_t)kv * head_size,
                  k_out + token * k_out_stride + (int64_t)kv * head_size, c, s, i, half);
    }
  }
}

template <typename T, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) silu_and_mul_kernel(
    T* __restrict__ out, const T* __restrict__ gate, const T* __restrict__ up, int64_t rows,
    int64_t cols, int64_t gate_stride, int64_t up_stride) {
  // out is [rows, cols] contiguous; gate and up rows start gate_stride / up_stride elements
  // apart (the two halves of one [gate | up] matmul output, LLaMA's MLP, are such rows)
  for (int64_t i = (int64_t)blockIdx.x * NUM_THREADS + threadIdx.x; i < rows * cols;
       i += (int64_t)gridDim.x * NUM_THREADS) {
    const int64_t row = i / cols, col = i - row * cols;
    const float g = to_float(gate[row * gate_stride + col]);
    out[i] = round_to<T>(in_t<T>(g / (1.f + expf(-g))) * to_float(up[row * up_stride + col]));
  }
}

// f(T()) for dtype 0 = float32, 1 = float16, 2 = bfloat16 (-1: another dtype).
template <typename F>
int by_dtype(int dtype, F f) {
  switch (dtype) {
    case 0: return f(float());
    case 1: return f(__half());
    case 2: return f(__nv_bfloat16());
    default: return -1;
  }
}

inline int launched() {
  return (int)cudaGetLastError();
}

}  // namespace layer
}  // namespace minipaged

extern "C" int minipaged_rms_norm(void* out, const void* input, const void* residual,
                                  void* sum_out, const void* weight, float eps, int num_tokens,
                                  int hidden, int64_t out_stride, int64_t input_stride,
                                  int64_t residual_stride, int64_t sum_stride, int dtype,
                                  cudaStream_t stream) {
  using namespace minipaged::layer;
  if (num_tokens == 0) return 0;
  (void)cudaGetLastError();  // an earlier call's error was that call's to report
  return by_dtype(dtype, [&](auto type) {
    using T = decltype(type);
    rms_norm_kernel<T, NORM_THREADS><<<num_tokens, NORM_THREADS, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(input), static_cast<const T*>(residual),
        static_cast<T*>(sum_out), static_cast<const T*>(weight), eps, hidden, out_stride,
        input_stride, residual_stride, sum_stride);
    return launched();
  });
}

extern "C" int minipaged_rotary(void* q_out, void* k_out, const void* q, const void* k,
                                const int64_t* positions, const void* cos, const void* sin,
                                int num_tokens, int num_heads, int num_kv_heads, int head_size,
                                int64_t q_stride, int64_t k_stride, int64_t q_out_stride,
                                int64_t k_out_stride, int dtype, cudaStream_t stream) {
  using namespace minipaged::layer;
  if (num_tokens == 0) return 0;
  (void)cudaGetLastError();
  return by_dtype(dtype, [&](auto type) {
    using T = decltype(type);
    rotary_kernel<T, ROTARY_THREADS><<<num_tokens, ROTARY_THREADS, 0, stream>>>(
        static_cast<T*>(q_out), static_cast<T*>(k_out), static_cast<const T*>(q),
        static_cast<const T*>(k), positions, static_cast<const T*>(cos),
        static_cast<const T*>(sin), num_heads, num_kv_heads, head_size, q_stride, k_stride,
        q_out_stride, k_out_stride);
    return launched();
  });
}

extern "C" int minipaged_silu_and_mul(void* out, const void* gate, const void* up, int64_t rows,
                                      int64_t cols, int64_t gate_stride, int64_t up_stride,
                                      int dtype, cudaStream_t stream) {
  using namespace minipaged::layer;
  const int64_t n = rows * cols;
  if (n == 0) return 0;
  (void)cudaGetLastError();
  const int64_t blocks64 = (n + ELEMENTWISE_THREADS - 1) / ELEMENTWISE_THREADS;
  const int blocks = blocks64 < 65535 ? (int)blocks64 : 65535;
  return by_dtype(dtype, [&](auto type) {
    using T = decltype(type);
    silu_and_mul_kernel<T, ELEMENTWISE_THREADS><<<blocks, ELEMENTWISE_THREADS, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(gate), static_cast<const T*>(up), rows, cols,
        gate_stride, up_stride);
    return launched();
  });
}
