// CUDA on the CPU: just enough of CUDA for the host C++ compiler to build and run csrc/*.cu.
//
// Every CUDA thread is a host thread. A launch runs the grid's blocks one after another on a pool
// of host threads (one per thread of the block, reused across launches), in blockIdx order
// (x fastest) unless set_block_order asks for another (a GPU promises none), so
//   threadIdx, blockIdx, blockDim, gridDim   are thread_local variables set per CUDA thread;
//   __syncthreads()                          is a real barrier of the block's threads;
//   __shfl_xor_sync / __shfl_sync / ...      are a real exchange among the 32 lanes of a warp;
//   __shared__                               is a function-local static: one copy, used by the
//                                            one block that runs at a time; its size is read
//                                            from the symbol table (as nvcc reports it), and
//   extern __shared__                        is a buffer of exactly the launch's dynamic size;
//                                            both are filled with 0xff bytes (NaN) before each
//                                            block, so a read before a write shows up;
//   __half, __nv_bfloat16                    are 16-bit structs with round-to-nearest-even
//                                            conversions, bit for bit as on the GPU;
//   atomicAdd, __threadfence, __ldcg         are a host atomic, a host fence and a plain load:
//                                            blocks run one at a time, so a block sees all that
//                                            the blocks before it wrote.
// The launch limits are those of an sm_90 part (device 0, H100) or an sm_80 part (device 1,
// A100): 1024 threads per block, 48 KiB of shared memory without opting in, 227 / 163 KiB with.
//
// Two things the preprocessor cannot do are done by minipaged/kernels/cuda_on_cpu.py on a temporary copy
// of each .cu file, line for line (so compiler and sanitizer reports name the real file and line):
//   kernel<<<grid, block, smem, stream>>>(args)  ->  kernel % LaunchConfig(grid, ...)(args)
//   extern __shared__ T name[];                  ->  T* name = dynamic_shared<T>();
//
// The shims csrc/cpu/include/cuda_runtime.h, cuda_fp16.h and cuda_bf16.h include this file, so
// the .cu sources are compiled unmodified otherwise.
#pragma once

#include <math.h>

#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---- keywords --------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static

// ---- vector types (the GPU's sizes and alignments) -------------------------------------------
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};
struct __attribute__((may_alias, aligned(16))) uint4 {
  unsigned x, y, z, w;
};
struct __attribute__((may_alias, aligned(8))) uint2 {
  unsigned x, y;
};
struct __attribute__((may_alias, aligned(8))) float2 {
  float x, y;
};
struct __attribute__((may_alias, aligned(16))) float4 {
  float x, y, z, w;
};

// ---- built-in variables: one set per CUDA thread -------------------------------------------
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

// ---- bit casts and math ------------------------------------------------------------------------
template <typename To, typename From>
inline To cuda_on_cpu_bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From), "same size only");
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}
inline float __uint_as_float(unsigned v) { return cuda_on_cpu_bit_cast<float>(v); }
inline float __int_as_float(int v) { return cuda_on_cpu_bit_cast<float>(v); }
inline unsigned __float_as_uint(float v) { return cuda_on_cpu_bit_cast<unsigned>(v); }
inline int __float_as_int(float v) { return cuda_on_cpu_bit_cast<int>(v); }
inline float __expf(float v) { return expf(v); }
inline float __fdividef(float a, float b) { return a / b; }
// one rounding each, never fused with a neighbour into an fma (the host build makes no fma)
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

// ---- half precision: storage types and round-to-nearest-even conversions ---------------------
struct __attribute__((may_alias, aligned(2))) __half {
  unsigned short __x;
};
struct __attribute__((may_alias, aligned(4))) __half2 {
  __half x, y;
};
struct __attribute__((may_alias, aligned(2))) __nv_bfloat16 {
  unsigned short __x;
};
struct __attribute__((may_alias, aligned(4))) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline float __half2float(__half h) {
  const unsigned sign = (unsigned)(h.__x & 0x8000u) << 16;
  const unsigned exponent = (h.__x >> 10) & 0x1fu;
  unsigned mantissa = h.__x & 0x3ffu;
  if (exponent == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));  // inf/NaN
  if (exponent != 0) return __uint_as_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return __uint_as_float(sign);  // +-0
  int e = 113;  // a subnormal half: normalise it
  while (!(mantissa & 0x400u)) {
    mantissa <<= 1;
    --e;
  }
  return __uint_as_float(sign | ((unsigned)e << 23) | ((mantissa & 0x3ffu) << 13));
}

inline __half __float2half_rn(float f) {
  const unsigned bits = __float_as_uint(f);
  const unsigned short sign = (unsigned short)((bits >> 16) & 0x8000u);
  const unsigned magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return {(unsigned short)(sign | 0x7e00u)};  // NaN stays NaN
  if (magnitude >= 0x477ff000u) return {(unsigned short)(sign | 0x7c00u)};  // rounds to inf
  if (magnitude < 0x38800000u) {  // below the smallest normal half: a subnormal or zero
    if (magnitude < 0x33000000u) return {sign};  // below half of the smallest subnormal
    const unsigned exponent = magnitude >> 23;
    const unsigned mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    // value = mantissa * 2^(exponent - 150); in units of 2^-24 (the smallest subnormal half)
    // that is mantissa >> (126 - exponent)
    const unsigned shift = 126 - exponent;
    const unsigned kept = mantissa >> shift;
    const unsigned rest = mantissa & ((1u << shift) - 1);
    const unsigned halfway = 1u << (shift - 1);
    const unsigned rounded = kept + (rest > halfway || (rest == halfway && (kept & 1u)));
    return {(unsigned short)(sign | rounded)};
  }
  // A normal half: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const unsigned rebased = magnitude - 0x38000000u;  // exponent - 112
  const unsigned kept = rebased >> 13;
  const unsigned rest = rebased & 0x1fffu;
  const unsigned rounded = kept + (rest > 0x1000u || (rest == 0x1000u && (kept & 1u)));
  return {(unsigned short)(sign | rounded)};  // a carry into the exponent is still right
}
inline __half __float2half(float f) { return __float2half_rn(f); }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline __half2 __float22half2_rn(float2 f) { return {__float2half_rn(f.x), __float2half_rn(f.y)}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half_rn(a), __float2half_rn(b)}; }

inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float((unsigned)b.__x << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return {(unsigned short)((bits >> 16) | 0x40u)};  // NaN
  const unsigned rounded = bits + 0x7fffu + ((bits >> 16) & 1u);  // to nearest, ties to even
  return {(unsigned short)(rounded >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float2 __bfloat1622float2(__nv_bfloat162 b) {
  return {__bfloat162float(b.x), __bfloat162float(b.y)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}

// ---- the runtime API -------------------------------------------------------------------------
typedef struct CUstream_st* cudaStream_t;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorInvalidDevice = 101,
  cudaErrorIllegalInstruction = 715,
  cudaErrorLaunchFailure = 719,
};
typedef cudaError_t cudaError;

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxGridDimX = 5,
  cudaDevAttrMaxGridDimY = 6,
  cudaDevAttrMaxGridDimZ = 7,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

struct cudaFuncAttributes {
  size_t sharedSizeBytes;    // static __shared__ memory
  size_t constSizeBytes;
  size_t localSizeBytes;
  int maxThreadsPerBlock;
  int numRegs;
  int ptxVersion;
  int binaryVersion;
  int cacheModeCA;
  int maxDynamicSharedSizeBytes;  // as set by cudaFuncSetAttribute (default: 48 KiB - static)
};

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* dst, int value, size_t bytes);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaDeviceSynchronize();

namespace cuda_on_cpu {

// The number of __shfl/__syncthreads/launch calls, for tests that want to see the work done.
struct Counters {
  long long launches, blocks, block_barriers, warp_exchanges;
};
Counters counters();
// The shuffles of one warp of one CUDA block, recorded for lesson 06: `trace_warp` arms the
// recorder for block `block`, warp `warp` (a negative warp disarms it) and clears it; each
// __shfl*_sync of a lane of that warp then appends what the lane sent, from which lane it read,
// and what it received, in the lane's program order. (`__syncwarp` is not recorded.)
struct ShuffleRecord {
  int lane, src_lane;
  std::uint64_t sent, received;  // the value's bytes (a float in the low 4 bytes)
};
void trace_warp(dim3 block, int warp);
std::vector<ShuffleRecord> take_warp_trace();
// Events of the traced build of the kernels (MINIPAGED_TRACE, lessons 05 and 06): while
// `trace_events(true)` is in force, every `record_event` call of a CUDA thread appends what it
// says (a kind, two integers, a float: their meaning is the kernel's, see MP_TRACE in
// paged_attention.cu) with the thread's blockIdx and linear thread index. `trace_events` clears
// the record; `take_events` hands it over in arrival order (threads interleave).
struct TraceEvent {
  int kind;
  unsigned block[3];
  int thread;
  long long a, b;
  float value;
};
void trace_events(bool enabled);
void record_event(int kind, long long a, long long b, float value);
std::vector<TraceEvent> take_events();
// Why the last failed launch of this host thread failed, in words ("" if it did not).
const char* last_error_detail();
// The order in which later launches run their blocks: IN_ORDER (blockIdx order, x fastest),
// REVERSED, or SHUFFLED (a new permutation per launch, drawn from `seed`). On a GPU blocks run
// in any order, so code that counts blocks (V2's fused reduce) is tested in several.
enum BlockOrder { IN_ORDER = 0, REVERSED = 1, SHUFFLED = 2 };
void set_block_order(BlockOrder order, unsigned seed = 0);

namespace detail {
cudaError_t func_attributes(cudaFuncAttributes* attributes, const void* kernel);
cudaError_t func_set_attribute(const void* kernel, cudaFuncAttribute attribute, int value);
void* dynamic_shared_base();
void syncthreads();
std::uint64_t warp_exchange(unsigned mask, std::uint64_t bits, int src_lane,
                            bool record = true);

// Runs body() once per CUDA thread of every block of the grid; sets the last error on failure.
struct KernelBody {
  void (*call)(void* closure);
  void* closure;
};
void launch(const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem, KernelBody body);

template <typename T>
inline T exchange(unsigned mask, T value, int src_lane) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "one register per lane");
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = warp_exchange(mask, bits, src_lane);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

int lane_id();  // from the thread's linear index in its block, as on the GPU
}  // namespace detail

template <typename T>
inline T* dynamic_shared() {
  return static_cast<T*>(detail::dynamic_shared_base());
}

// `kernel % LaunchConfig(grid, block, smem, stream)(args...)` is the rewritten `<<<...>>>`:
// LaunchConfig(...)(args...) keeps the arguments, `%` (found by argument-dependent lookup)
// converts them to the kernel's parameter types, as the CUDA runtime copies them, and runs it.
template <typename... A>
struct PendingLaunch {
  dim3 grid, block;
  size_t dynamic_smem;
  std::tuple<A...> args;
};

struct LaunchConfig {
  dim3 grid, block;
  size_t dynamic_smem;
  LaunchConfig(dim3 grid_, dim3 block_, size_t dynamic_smem_ = 0, cudaStream_t = nullptr)
      : grid(grid_), block(block_), dynamic_smem(dynamic_smem_) {}
  template <typename... A>
  PendingLaunch<std::decay_t<A>...> operator()(A&&... args) const {
    return {grid, block, dynamic_smem, std::tuple<std::decay_t<A>...>(std::forward<A>(args)...)};
  }
};

template <typename... P, typename... A>
void operator%(void (*kernel)(P...), PendingLaunch<A...>&& pending) {
  static_assert(sizeof...(P) == sizeof...(A), "wrong number of kernel arguments");
  struct Closure {
    void (*kernel)(P...);
    std::tuple<std::decay_t<P>...> params;
  };
  Closure closure{kernel, std::apply([](auto&... a) { return std::tuple<std::decay_t<P>...>(a...); },
                                     pending.args)};
  detail::KernelBody body{
      [](void* c) {
        auto* self = static_cast<Closure*>(c);
        std::apply(self->kernel, self->params);
      },
      &closure};
  detail::launch(reinterpret_cast<const void*>(kernel), pending.grid, pending.block,
                 pending.dynamic_smem, body);
}

}  // namespace cuda_on_cpu

template <typename T>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, T* kernel) {
  return cuda_on_cpu::detail::func_attributes(attributes, reinterpret_cast<const void*>(kernel));
}
template <typename T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attribute, int value) {
  return cuda_on_cpu::detail::func_set_attribute(reinterpret_cast<const void*>(kernel), attribute,
                                                 value);
}

// ---- global memory atomics, fences and cache hints -------------------------------------------
// Real host atomics (ThreadSanitizer sees them), although blocks run one at a time.
inline int atomicAdd(int* address, int value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}
inline unsigned atomicAdd(unsigned* address, unsigned value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
template <typename T>
inline T __ldcg(const T* p) {  // "cache globally" (L2, not L1): one memory here
  return *p;
}

// ---- block and warp synchronisation ------------------------------------------------------------
inline void __syncthreads() { cuda_on_cpu::detail::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  cuda_on_cpu::detail::warp_exchange(mask, 0, 0, /*record=*/false);
}

// Only whole-warp shuffles are supported: mask must name all 32 lanes (the launch fails
// otherwise). `width` splits the warp into segments as on the GPU.
template <typename T>
inline T __shfl_sync(unsigned mask, T value, int src_lane, int width = 32) {
  const int lane = cuda_on_cpu::detail::lane_id();
  const int src = lane / width * width + (src_lane % width + width) % width;
  return cuda_on_cpu::detail::exchange(mask, value, src);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  const int lane = cuda_on_cpu::detail::lane_id();
  int src = lane ^ lane_mask;
  if (src / width != lane / width || src >= 32) src = lane;
  return cuda_on_cpu::detail::exchange(mask, value, src);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  const int lane = cuda_on_cpu::detail::lane_id();
  int src = lane + (int)delta;
  if (src / width != lane / width || src >= 32) src = lane;
  return cuda_on_cpu::detail::exchange(mask, value, src);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  const int lane = cuda_on_cpu::detail::lane_id();
  const int src = lane % width >= (int)delta ? lane - (int)delta : lane;
  return cuda_on_cpu::detail::exchange(mask, value, src);
}
