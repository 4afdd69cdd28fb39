// paged_attention.cu's shared helpers: the trace switch, warp and lane constants, 16-byte
// vectors and their fp32 conversions, and the butterfly and block-wide reductions.
// Part of paged_attention.cu, included by it once per translation unit (no include guard).
// The CPU builds paste it into that file (minipaged/kernels/cuda_on_cpu.py).

#ifdef MINIPAGED_TRACE
#define MP_TRACE(kind, a, b, value) \
  ::cuda_on_cpu::record_event((kind), (long long)(a), (long long)(b), (float)(value))
#else
#define MP_TRACE(kind, a, b, value) ((void)0)
#endif

namespace minipaged {

constexpr int WARP_SIZE = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;

#ifdef MINIPAGED_SHARED_GROUP_LOAD
constexpr bool SHARED_GROUP_LOAD = true;
#else
constexpr bool SHARED_GROUP_LOAD = false;
#endif

// What MP_TRACE records (a, b, value), per CUDA thread; the reader is cuda_on_cpu.run_traced.
enum TraceKind {
  TRACE_VISIT = 1,   // phase 2: the warp's loop reaches a KV block: (block of the sequence,
                     // physical block, 0)
  TRACE_KEY_LOAD,    // one global load of key bytes in phase 2: (address, bytes, 0)
  TRACE_LOGIT,       // phase 2, by the first lane of a group: (token of the sequence, query
                     // head of the kv head's group (0 in V1 and V2), scaled q.k)
  TRACE_MAX,         // phase 3: (query head of the group, 0, the block's maximum logit)
  TRACE_EXP_SUM,     // phase 3: (query head of the group, 0, the block's sum of exponentials)
  TRACE_LANE_SUM,    // phase 4, before any shuffle: (row, slice, this lane's partial sum)
  TRACE_WARP_SUM,    // phase 4, the warp's row sum written for the cross-warp add: (row, warp, sum)
  TRACE_VALUE_LOAD,  // one global load of value bytes in phase 4: (address, bytes, 0)
};

// ----------------------------------------------------------------------------------------------
// 16-byte vectors: one load instruction brings X = 16 / sizeof(T) elements, converted to fp32.
// (Explicit intrinsics only: torch builds with the implicit half/bfloat16 conversions disabled.)
// ----------------------------------------------------------------------------------------------
template <typename T>
struct Vec16 {
  static constexpr int N = 16 / sizeof(T);
};

// One 16-byte load. The pointer must be 16-byte aligned: the cache layouts guarantee it.
template <typename T>
__device__ __forceinline__ uint4 load16(const T* p) {
  return *reinterpret_cast<const uint4*>(p);
}

// The 16 loaded bytes as Vec16<T>::N floats.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[Vec16<T>::N]);

template <>
__device__ __forceinline__ void unpack<float>(const uint4& raw, float (&out)[4]) {
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
}

template <>
__device__ __forceinline__ void unpack<__half>(const uint4& raw, float (&out)[8]) {
  const __half2* h2 = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h2[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <>
__device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& raw, float (&out)[8]) {
  const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(b2[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// An 8-bit cache (lesson 18): 16 codes in the 16 bytes.
template <typename C>
__device__ __forceinline__ void unpack_codes(const uint4& raw, float (&out)[16]) {
  const C* codes = reinterpret_cast<const C*>(&raw);
#pragma unroll
  for (int i = 0; i < 16; ++i) out[i] = to_float(codes[i]);
}
template <>
__device__ __forceinline__ void unpack<int8_t>(const uint4& raw, float (&out)[16]) {
  unpack_codes<int8_t>(raw, out);
}
template <>
__device__ __forceinline__ void unpack<fp8_e4m3>(const uint4& raw, float (&out)[16]) {
  unpack_codes<fp8_e4m3>(raw, out);
}

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// Butterfly inside a warp. At step `mask` lane l exchanges with lane l ^ mask, and both keep
// op(own, partner). Starting at FIRST_MASK and halving down to LAST_MASK, every lane ends up
// with the result over its 2 * FIRST_MASK / LAST_MASK-lane team (the lanes that differ from it
// only in the bits FIRST_MASK .. LAST_MASK).
template <int FIRST_MASK, int LAST_MASK, typename Op>
__device__ __forceinline__ float butterfly(float v, Op op) {
#pragma unroll
  for (int mask = FIRST_MASK; mask >= LAST_MASK; mask /= 2) {
    v = op(v, __shfl_xor_sync(FULL_MASK, v, mask));
  }
  return v;
}

// A whole-block reduction of one float per thread; every thread gets the result.
//   step 1: butterfly in each warp over masks 16 .. LAST_MASK (lanes l and l^16, then l^8, ...);
//   step 2: lane 0 of warp w writes its value to scratch[w]; barrier;
//   step 3: in every warp, lane l < NUM_WARPS reads scratch[l] and a butterfly over masks
//           NUM_WARPS/2 .. 1 combines the warps; lane 0's value is broadcast to all lanes.
// Each reduction must use its own `scratch` slots (no barrier guards their reuse).
template <int NUM_WARPS, int LAST_MASK, typename Op>
__device__ __forceinline__ float block_reduce(float v, float* scratch, float identity, Op op) {
  const int warp = threadIdx.x / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  v = butterfly<WARP_SIZE / 2, LAST_MASK>(v, op);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < NUM_WARPS ? scratch[lane] : identity;
  v = butterfly<NUM_WARPS / 2, 1>(v, op);
  return __shfl_sync(FULL_MASK, v, 0);
}


}  // namespace minipaged
