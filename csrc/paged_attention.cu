// Single-query paged attention: the decode kernels of lessons 05 and 06.
//
// Every running sequence has one new token whose query must attend to all the keys and values
// already in the KV cache. Those keys and values are not contiguous: they live in fixed-size
// blocks scattered over a pool, and the sequence's block table says where. These kernels read
// them through the block table.
//
// Layouts (the same in minipaged/kernels/reference.py and minipaged/lab/emulator.py):
//   query        [num_seqs, num_heads, head_size]              (any strides for the first two dims)
//   key_cache    [num_blocks, num_kv_heads, head_size / X, block_size, X]   X = 16 / sizeof(T)
//   value_cache  [num_blocks, num_kv_heads, head_size, block_size]
//                (each cache: the last dims contiguous, its own strides for the first two)
//   block_tables [num_seqs, max_blocks_per_seq] int32
//   context_lens [num_seqs] int32
//   out          [num_seqs, num_heads, head_size]              contiguous
//   window       int (KernelArgs::window): a sliding window's tokens, 0 = the whole context.
//                The newest token (position context_len - 1) then sees positions
//                context_len - window .. context_len - 1 only: every kernel starts its block
//                loop at the window's first block and masks that block's tokens before the
//                window (logit -FLT_MAX, value 0); V2 and version 3 skip the partitions wholly
//                before it, and their reduce combines the others only. A block wholly before
//                the window is never read (it may be back on the free list).
//
// Work split: one CUDA block of 128 threads = 4 warps of 32 lanes per (head, sequence) in V1,
// per (head, sequence, partition of PARTITION_SIZE tokens) in V2. Either way a CUDA block runs
// `attend` on a range of tokens:
//
//   phase 1  query -> shared memory (fp32)
//   phase 2  q.k: warp w takes KV blocks w, w+4, w+8, ... A warp is cut into thread groups of
//            G = max(32 / BLOCK_SIZE, 1) lanes, one group per token of the block, so one pass of
//            the warp covers exactly one KV block. The G lanes of a group share the key's 16-byte
//            chunks (lane j takes chunks j, j+G, j+2G, ...) and add up their partial dot products
//            with a butterfly. The scaled logits go to shared memory.
//   phase 3  softmax: maximum (butterfly in each warp, then across warps through shared memory),
//            exponentials and their sum (the same two-level reduction), then normalise in place.
//   phase 4  probabilities . V: each lane owns some rows (head dimensions) and one 16-byte slice
//            of the block's tokens; lanes that share a row add up with a butterfly, then the
//            four warps add up through shared memory.
//
// With grouped-query attention a third kernel (version 3, after V2 below) gives one CUDA block
// to each (kv head, sequence, partition) and runs the four phases for all the query heads that
// share the kv head, so each key and value is loaded once per group, not once per query head.
//
// V1 keeps one fp32 logit per token of the context in (dynamic) shared memory: one CUDA block
// per sequence and head, the whole context. Long contexts would leave most SMs idle and run out
// of shared memory, so V2 splits the context into partitions: each CUDA block writes its
// partition's maximum logit, sum of exponentials and normalised output, and a second kernel
// combines the partitions (softmax is a weighted average of the partitions' softmaxes). With the
// fused reduce (minipaged_set_v2_reduce(1); off by default until it is timed on a GPU) there is
// no second kernel: the CUDA block that finishes a (sequence, head)'s partitions last combines
// them (see "The fused reduce" below).
//
// Readability first: every reduction says which lanes exchange values. The emulator in
// minipaged/lab/emulator.py follows this file step by step.
//
// Two compile-time switches, both off in every GPU build (minipaged/kernels/cuda_on_cpu.py
// defines them for its CPU builds of lesson 06 and of lesson 05's load comparison):
//   MINIPAGED_TRACE                records the loops as they run: MP_TRACE(kind, a, b, value)
//                                  calls the CPU runtime's recorder; undefined, it is nothing.
//   MINIPAGED_SHARED_GROUP_LOAD    phase 2 loads the keys the way vLLM's kernel does: the G
//                                  lanes of a thread group share each 16-byte chunk, 16 / G
//                                  bytes per lane, instead of each lane loading whole chunks.

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <atomic>
#include <cfloat>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "kernels.h"  // the extern "C" declarations: the compiler checks they match
#include "kv_quant.cuh"  // 8-bit codes (lesson 18) and to_float

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

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
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

// ----------------------------------------------------------------------------------------------
// The work of one CUDA block: one query head over the tokens [start, end) of one sequence
// ----------------------------------------------------------------------------------------------
// Shared memory (declared by the kernels, which know its sizes): logits[end - start] (fp32),
// q_smem[HEAD_SIZE], red_smem[2 * NUM_WARPS], out_smem[NUM_WARPS * HEAD_SIZE].
// On return out_smem holds each warp's part of the *normalised* output (thread d adds up
// out_smem[w * HEAD_SIZE + d] over the warps, see `write_output`), and the block's maximum logit
// and sum of exponentials are returned in every thread.
struct PartitionStats {
  float max_logit;
  float exp_sum;
};

// An 8-bit cache's scales for `attend` (lesson 18): already offset to the kv head; the scale of
// token t of physical block b is at [b * block_stride + t]. Null pointers for a 16/32-bit cache.
struct CodeScales {
  const float* key;
  const float* value;
  int64_t block_stride;
};

// ---- phase 2's key load, two ways --------------------------------------------------------
// Both return this lane's part of q.k for one token: the G lanes of the token's thread group
// split the key between them (G = 32 / BLOCK_SIZE, at least 1), and their parts add up to q.k.
// `k` points at chunk 0 of the token's key; chunk c (X elements, 16 bytes) is at
// k + c * BLOCK_SIZE * X.

// Ours: lane j of the group loads whole chunks j, j + G, j + 2G, ...: each load is 16 bytes.
// Load first, then multiply: all of this lane's 16-byte loads are in flight together. The chunks
// stay in registers, so the grouped kernel (version 3) multiplies them by several queries.
template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
struct OwnKeyChunks {
  static constexpr int X = Vec16<T>::N;
  static constexpr int G = BLOCK_SIZE < WARP_SIZE ? WARP_SIZE / BLOCK_SIZE : 1;
  static constexpr int NUM_K_CHUNKS = HEAD_SIZE / X;
  static constexpr int K_CHUNKS_PER_LANE = (NUM_K_CHUNKS + G - 1) / G;
  uint4 raw[K_CHUNKS_PER_LANE];

  __device__ __forceinline__ void load(const T* k, int lane_in_group) {
#pragma unroll
    for (int i = 0; i < K_CHUNKS_PER_LANE; ++i) {
      const int c = lane_in_group + i * G;
      if (c < NUM_K_CHUNKS) {
        raw[i] = load16(k + c * BLOCK_SIZE * X);
        MP_TRACE(TRACE_KEY_LOAD, reinterpret_cast<uintptr_t>(k + c * BLOCK_SIZE * X), 16, 0);
      }
    }
  }

  // This lane's part of q.k for the query in q_smem (fp32, HEAD_SIZE).
  __device__ __forceinline__ float dot(const float* q_smem, int lane_in_group) const {
    float partial = 0.f;
#pragma unroll
    for (int i = 0; i < K_CHUNKS_PER_LANE; ++i) {
      const int c = lane_in_group + i * G;
      if (c < NUM_K_CHUNKS) {
        float k_vals[X];
        unpack<T>(raw[i], k_vals);
        // the matching query chunk, read from shared memory 4 floats at a time
        const float4* q4 = reinterpret_cast<const float4*>(q_smem + c * X);
#pragma unroll
        for (int e = 0; e < X / 4; ++e) {
          const float4 qv = q4[e];
          partial += qv.x * k_vals[4 * e] + qv.y * k_vals[4 * e + 1] +
                     qv.z * k_vals[4 * e + 2] + qv.w * k_vals[4 * e + 3];
        }
      }
    }
    return partial;
  }
};

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
__device__ __forceinline__ float key_dot_own_chunks(const T* k, const float* q_smem,
                                                    int lane_in_group) {
  OwnKeyChunks<T, HEAD_SIZE, BLOCK_SIZE> chunks;
  chunks.load(k, lane_in_group);
  return chunks.dot(q_smem, lane_in_group);
}

// One load of BYTES bytes (16, 8 or 4): the register type that holds it.
template <int BYTES> struct LoadType;
template <> struct LoadType<16> { using type = uint4; };
template <> struct LoadType<8> { using type = uint2; };
template <> struct LoadType<4> { using type = unsigned; };

// vLLM's way: the G lanes of a group fetch each 16-byte chunk *together*, VEC_SIZE =
// 16 / (G * sizeof(T)) elements per lane (lane j takes elements [j * VEC_SIZE, (j+1) * VEC_SIZE)
// of the chunk), and the group walks the key chunk by chunk. Same bytes, G times as many (G
// times smaller) load instructions per lane.
template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
__device__ __forceinline__ float key_dot_shared_chunks(const T* k, const float* q_smem,
                                                       int lane_in_group) {
  constexpr int X = Vec16<T>::N;
  constexpr int G = BLOCK_SIZE < WARP_SIZE ? WARP_SIZE / BLOCK_SIZE : 1;
  constexpr int VEC_SIZE = X / G;  // = 16 / (G * sizeof(T))
  constexpr int NUM_K_CHUNKS = HEAD_SIZE / X;  // one load per chunk per lane
  using Raw = typename LoadType<VEC_SIZE * (int)sizeof(T)>::type;
  static_assert(VEC_SIZE >= 1 && VEC_SIZE * G == X, "a group's lanes split a chunk evenly");
  Raw k_raw[NUM_K_CHUNKS];
#pragma unroll
  for (int c = 0; c < NUM_K_CHUNKS; ++c) {
    const T* p = k + c * BLOCK_SIZE * X + lane_in_group * VEC_SIZE;
    k_raw[c] = *reinterpret_cast<const Raw*>(p);
    MP_TRACE(TRACE_KEY_LOAD, reinterpret_cast<uintptr_t>(p), sizeof(Raw), 0);
  }
  float partial = 0.f;
#pragma unroll
  for (int c = 0; c < NUM_K_CHUNKS; ++c) {
    const T* vals = reinterpret_cast<const T*>(&k_raw[c]);
    const float* qc = q_smem + c * X + lane_in_group * VEC_SIZE;
#pragma unroll
    for (int e = 0; e < VEC_SIZE; ++e) partial += qc[e] * to_float(vals[e]);
  }
  return partial;
}

// ---- phase 4's value load ------------------------------------------------------------------
// One lane's 16-byte slice of a value row: the values of tokens first_token .. + X - 1 (from
// the range's start), as floats. Tokens at or past num_tokens (the tail of the last block) get
// value 0: their cache slots were never written, and 0 * NaN = NaN. So do the tokens before
// first_valid (a sliding window's first block: tokens that left the window), whose probability
// is 0 but whose slots may hold anything.
template <typename C>
__device__ __forceinline__ void load_value_slice(const C* p, int first_token, int first_valid,
                                                 int num_tokens, float (&vals)[Vec16<C>::N]) {
  unpack<C>(load16(p), vals);
  MP_TRACE(TRACE_VALUE_LOAD, reinterpret_cast<uintptr_t>(p), 16, 0);
  if (first_token < first_valid || first_token + Vec16<C>::N > num_tokens) {
#pragma unroll
    for (int j = 0; j < Vec16<C>::N; ++j) {
      if (first_token + j < first_valid || first_token + j >= num_tokens) vals[j] = 0.f;
    }
  }
}

// C is the cache's element type: T itself, or an 8-bit code (int8_t, fp8_e4m3) with `scales`.
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, typename C = T>
__device__ __forceinline__ PartitionStats attend(
    const T* __restrict__ q,              // [HEAD_SIZE], this head's query
    const C* __restrict__ key_cache,      // already offset to this kv head
    const C* __restrict__ value_cache,    // already offset to this kv head
    const int* __restrict__ block_table,  // this sequence's row
    int start, int end, int visible, int64_t k_block_stride, int64_t v_block_stride,
    float scale, float* logits, float* q_smem, float* red_smem, float* out_smem,
    const CodeScales scales = CodeScales{nullptr, nullptr, 0}) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  constexpr bool CODES = !std::is_same<C, T>::value;     // an 8-bit cache with scales
  constexpr int X = Vec16<C>::N;                         // elements per 16-byte vector
  // phase 2 (q.k) constants
  constexpr int G = BLOCK_SIZE < WARP_SIZE ? WARP_SIZE / BLOCK_SIZE : 1;  // lanes per token
  // phase 4 (probabilities . V) constants
  constexpr int V_VEC = X;                               // tokens in one lane's slice of a row
  constexpr int V_VECS_PER_ROW = BLOCK_SIZE / V_VEC;     // lanes that share a row
  constexpr int ROWS_PER_PASS = WARP_SIZE / V_VECS_PER_ROW;
  constexpr int ROWS_PER_LANE = (HEAD_SIZE + ROWS_PER_PASS - 1) / ROWS_PER_PASS;
  static_assert(NUM_THREADS % WARP_SIZE == 0, "whole warps only");
  static_assert((NUM_WARPS & (NUM_WARPS - 1)) == 0, "the cross-warp butterfly needs 2^k warps");
  static_assert(BLOCK_SIZE <= WARP_SIZE && WARP_SIZE % BLOCK_SIZE == 0,
                "one pass of a warp covers exactly one KV block");
  static_assert(HEAD_SIZE % X == 0, "a key is a whole number of 16-byte chunks");
  static_assert(BLOCK_SIZE % V_VEC == 0, "a value row is a whole number of 16-byte vectors");

  const int warp = threadIdx.x / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  // KV blocks [first_block, first_block + num_blocks) of the block table cover [start, end);
  // `start` is a multiple of BLOCK_SIZE. A sliding window: the tokens before `visible` (those of
  // the range's first block that left the window, if any) get logit -FLT_MAX, so probability 0,
  // and value 0; the callers start the range at the window's first block, so no block wholly
  // before the window is read.
  const int first_block = start / BLOCK_SIZE;
  const int num_blocks = (end - start + BLOCK_SIZE - 1) / BLOCK_SIZE;
  const int num_tokens = end - start;
  const int first_valid = visible - start;  // from `start`; <= 0 when the whole range is seen

  // ---- phase 1: the query into shared memory --------------------------------------------------
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) q_smem[d] = to_float(q[d]);
  __syncthreads();

  // ---- phase 2: q.k for every token ------------------------------------------------------------
  const int token_in_block = lane / G;  // which token of the block this lane's group handles
  const int lane_in_group = lane % G;   // which of the key's chunks this lane handles
  float qk_max = -FLT_MAX;
  for (int b = warp; b < num_blocks; b += NUM_WARPS) {
    const int64_t physical_block = block_table[first_block + b];
    MP_TRACE(TRACE_VISIT, first_block + b, physical_block, 0);
    const C* k = key_cache + physical_block * k_block_stride +
                 token_in_block * X;  // chunk c of this token is at k + c * BLOCK_SIZE * X
    // this lane's part of q.k: with our key load, or with vLLM's (MINIPAGED_SHARED_GROUP_LOAD)
    float partial;
    if constexpr (SHARED_GROUP_LOAD) {
      partial = key_dot_shared_chunks<C, HEAD_SIZE, BLOCK_SIZE>(k, q_smem, lane_in_group);
    } else {
      partial = key_dot_own_chunks<C, HEAD_SIZE, BLOCK_SIZE>(k, q_smem, lane_in_group);
    }
    // The G lanes of a group are neighbours (lanes G*t .. G*t+G-1): a butterfly over masks
    // G/2 .. 1 adds their partial products, and every lane of the group gets the full q.k.
    // (With G == 1 there is nothing to add and the loop runs zero times.)
    float qk = scale * butterfly<G / 2, 1>(partial, SumOp());

    const int token = b * BLOCK_SIZE + token_in_block;  // from `start`
    if (token < num_tokens) {
      // an 8-bit cache: q . (codes * s) = (q . codes) * s, one multiply per token
      if constexpr (CODES) qk *= scales.key[physical_block * scales.block_stride + token_in_block];
      // Left the window: exp(-FLT_MAX - max) is 0 in phase 3, and the maximum never drops to
      // -FLT_MAX (the range holds at least one token of the window).
      if (token < first_valid) qk = -FLT_MAX;
      if (lane_in_group == 0) {
        logits[token] = qk;
        MP_TRACE(TRACE_LOGIT, start + token, 0, qk);
      }
      qk_max = fmaxf(qk_max, qk);
    }
  }

  // ---- phase 3: softmax ------------------------------------------------------------------------
  // >>> softmax_phase: lesson 06's exercise builds the kernel with the learner's code in place of
  // the lines up to "<<< softmax_phase" (minipaged/lab/kernel_exercise.py)
  // Maximum: lanes of one group already agree, so the warp butterfly stops at mask G
  // (16, 8, ..., G); then the warps combine through red_smem[0 .. NUM_WARPS).
  // The barrier inside block_reduce also makes every logit visible to every thread.
  const float max_logit = block_reduce<NUM_WARPS, G>(qk_max, red_smem, -FLT_MAX, MaxOp());
  MP_TRACE(TRACE_MAX, 0, 0, max_logit);

  float exp_sum = 0.f;
  for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) {
    const float e = expf(logits[i] - max_logit);
    logits[i] = e;
    exp_sum += e;
  }
  // Sum: each thread holds its own partial sum, so the warp butterfly runs all the way (16..1);
  // then the warps combine through red_smem[NUM_WARPS .. 2*NUM_WARPS).
  exp_sum = block_reduce<NUM_WARPS, 1>(exp_sum, red_smem + NUM_WARPS, 0.f, SumOp());
  MP_TRACE(TRACE_EXP_SUM, 0, 0, exp_sum);
  const float inv_sum = 1.f / exp_sum;
  for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) logits[i] *= inv_sum;
  __syncthreads();  // every probability is written before any warp reads them
  // <<< softmax_phase

  // ---- phase 4: probabilities . V -----------------------------------------------------------
  // A value block is HEAD_SIZE rows of BLOCK_SIZE tokens. Lane l works on row slot
  // l / V_VECS_PER_ROW and on the tokens [s * V_VEC, (s + 1) * V_VEC) with s = l % V_VECS_PER_ROW;
  // one pass of the warp covers ROWS_PER_PASS rows, and a lane does rows
  // row_in_pass, row_in_pass + ROWS_PER_PASS, ... (ROWS_PER_LANE of them).
  const int row_in_pass = lane / V_VECS_PER_ROW;
  const int slice = lane % V_VECS_PER_ROW;
  float acc[ROWS_PER_LANE];
#pragma unroll
  for (int i = 0; i < ROWS_PER_LANE; ++i) acc[i] = 0.f;

  for (int b = warp; b < num_blocks; b += NUM_WARPS) {
    const int64_t physical_block = block_table[first_block + b];
    const C* v = value_cache + physical_block * v_block_stride +
                 slice * V_VEC;  // row r of this lane's slice is at v + r * BLOCK_SIZE
    const int first_token = b * BLOCK_SIZE + slice * V_VEC;  // from `start`
    // Tokens past the range (the tail of the last block) get probability 0 *and* value 0
    // (load_value_slice): neither their logits slots nor their cache slots were written.
    float probs[V_VEC];
#pragma unroll
    for (int j = 0; j < V_VEC; ++j) {
      probs[j] = first_token + j < num_tokens ? logits[first_token + j] : 0.f;
      // an 8-bit cache: each probability carries its token's value scale
      if constexpr (CODES) {
        if (first_token + j < num_tokens) {
          probs[j] *= scales.value[physical_block * scales.block_stride + slice * V_VEC + j];
        }
      }
    }

#pragma unroll
    for (int i = 0; i < ROWS_PER_LANE; ++i) {
      const int row = row_in_pass + i * ROWS_PER_PASS;
      if (row < HEAD_SIZE) {
        float vals[V_VEC];
        load_value_slice<C>(v + row * BLOCK_SIZE, first_token, first_valid, num_tokens, vals);
#pragma unroll
        for (int j = 0; j < V_VEC; ++j) acc[i] += probs[j] * vals[j];
      }
    }
  }

  // Lanes that share a row are neighbours (V_VECS_PER_ROW of them): a butterfly over masks
  // V_VECS_PER_ROW/2 .. 1 adds their slices, so each lane holds its rows' sums for this warp.
#pragma unroll
  for (int i = 0; i < ROWS_PER_LANE; ++i) {
    MP_TRACE(TRACE_LANE_SUM, row_in_pass + i * ROWS_PER_PASS, slice, acc[i]);
    acc[i] = butterfly<V_VECS_PER_ROW / 2, 1>(acc[i], SumOp());
  }

  // Warps combine through shared memory: the first lane of each row team writes the warp's row
  // sums; after the barrier thread d can add up row d over the NUM_WARPS warps.
  if (slice == 0) {
#pragma unroll
    for (int i = 0; i < ROWS_PER_LANE; ++i) {
      const int row = row_in_pass + i * ROWS_PER_PASS;
      if (row < HEAD_SIZE) {
        out_smem[warp * HEAD_SIZE + row] = acc[i];
        MP_TRACE(TRACE_WARP_SUM, row, warp, acc[i]);
      }
    }
  }
  __syncthreads();
  return {max_logit, exp_sum};
}

// Thread d adds up row d of the warps' partial outputs and stores it as OutT.
template <typename OutT, int HEAD_SIZE, int NUM_THREADS>
__device__ __forceinline__ void write_output(OutT* out_row, const float* out_smem) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) sum += out_smem[w * HEAD_SIZE + d];
    out_row[d] = from_float<OutT>(sum);
  }
}

// One value in every element of an output row, for the contexts `attend` does not take
// (uniform over the CUDA block):
//   - an empty context (context_len 0): zeros, not 0 / 0 = NaN. Attention over no tokens adds
//     up no values; vLLM's kernel gives zeros too (it pads batches with empty sequences).
//     Reading the lengths to refuse it would cost the host a synchronisation, so only the checks
//     that see host data refuse it (the binding and Python wrapper given CPU lengths, the CPU
//     build, the C++ CPU op).
//   - a negative context, or one longer than the caller's max_context_len: NaN, loudly, instead
//     of overrunning shared memory. The caller broke its promise; nothing sensible exists.
template <typename OutT, int HEAD_SIZE, int NUM_THREADS>
__device__ __forceinline__ void fill_row(OutT* out_row, float value) {
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) out_row[d] = from_float<OutT>(value);
}
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// Arguments shared by the kernels.
struct KernelArgs {
  const int* block_tables;  // [num_seqs, max_blocks_per_seq]
  const int* context_lens;  // [num_seqs]
  int max_blocks_per_seq, num_kv_heads;
  int64_t q_seq_stride, q_head_stride;
  int64_t k_block_stride, k_head_stride, v_block_stride, v_head_stride;
  float scale;
  // an 8-bit cache (lesson 18): [num_blocks, num_kv_heads, block_size] each; else null
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  // a sliding window's tokens (Mistral, Gemma 3's sliding layers), 0: the whole context
  int window = 0;
};

// The first position the newest token sees: 0, or with a sliding window of `window` tokens
// (0: none) the oldest of the window's, context_len - window. (0 for an empty context.)
__device__ __forceinline__ int first_visible(int context_len, int window) {
  return window > 0 && window < context_len ? context_len - window : 0;
}

// The scales `attend` reads for kv head `kv_head`, a block of BLOCK_SIZE tokens.
template <int BLOCK_SIZE>
__device__ __forceinline__ CodeScales code_scales(const KernelArgs& a, int kv_head) {
  if (a.k_scales == nullptr) return CodeScales{nullptr, nullptr, 0};
  return CodeScales{a.k_scales + (int64_t)kv_head * BLOCK_SIZE,
                    a.v_scales + (int64_t)kv_head * BLOCK_SIZE,
                    (int64_t)a.num_kv_heads * BLOCK_SIZE};
}

// ----------------------------------------------------------------------------------------------
// V1: one CUDA block per (head, sequence), the whole context at once
// ----------------------------------------------------------------------------------------------
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, typename C = T>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v1_kernel(
    T* __restrict__ out,                  // [num_seqs, num_heads, HEAD_SIZE]
    const T* __restrict__ query,          // [num_seqs, num_heads, HEAD_SIZE]
    const C* __restrict__ key_cache,      // [num_blocks, num_kv_heads, HEAD_SIZE/X, BLOCK_SIZE, X]
    const C* __restrict__ value_cache,    // [num_blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE]
    const KernelArgs a, int logits_capacity) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  const int head = blockIdx.x;
  const int num_heads = gridDim.x;
  const int seq = blockIdx.y;
  const int kv_head = head / (num_heads / a.num_kv_heads);  // grouped-query attention
  const int context_len = a.context_lens[seq];
  T* out_row = out + ((int64_t)seq * num_heads + head) * HEAD_SIZE;

  extern __shared__ float logits[];                 // [logits_capacity]: one float per token
  __shared__ __align__(16) float q_smem[HEAD_SIZE];  // the query, fp32
  __shared__ float red_smem[2 * NUM_WARPS];         // max and sum scratch, one slot per warp
  __shared__ float out_smem[NUM_WARPS * HEAD_SIZE];  // each warp's partial output

  if (context_len <= 0 || context_len > logits_capacity) {
    // Empty: zeros, not 0 / 0. Negative, or longer than max_context_len promised: NaN, loudly,
    // instead of overrunning shared memory. (See fill_row.)
    fill_row<T, HEAD_SIZE, NUM_THREADS>(out_row, context_len == 0 ? 0.f : quiet_nan());
    return;
  }
  // A sliding window: from the window's first block (the blocks before it are never read).
  const int visible = first_visible(context_len, a.window);
  attend<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, C>(
      query + seq * a.q_seq_stride + head * a.q_head_stride,
      key_cache + kv_head * a.k_head_stride, value_cache + kv_head * a.v_head_stride,
      a.block_tables + (int64_t)seq * a.max_blocks_per_seq, visible / BLOCK_SIZE * BLOCK_SIZE,
      context_len, visible, a.k_block_stride, a.v_block_stride, a.scale, logits, q_smem,
      red_smem, out_smem, code_scales<BLOCK_SIZE>(a, kv_head));
  write_output<T, HEAD_SIZE, NUM_THREADS>(out_row, out_smem);
}

// >>> end of the exercise build: lesson 06's exercise compiles the file down to here (V1, one
// shape); the V2 kernels and the launch code follow.
// ----------------------------------------------------------------------------------------------
// V2: one CUDA block per (head, sequence, partition), then one per (head, sequence) to combine
// ----------------------------------------------------------------------------------------------
constexpr int PARTITION_SIZE = 512;  // tokens per partition: 2 KiB of logits, a multiple of 32
// When few sequences run, 512-token partitions leave most of the GPU idle (batch 1, 32 heads and
// 4,096 tokens: 256 CUDA blocks for 132 SMs). The automatic plan then halves the partition, down
// to MIN_PARTITION_SIZE tokens, until the grid has V2_BLOCKS_PER_SM CUDA blocks per SM: more,
// shorter partitions, as FlashDecoding does. The reduce kernel's work grows with the number of
// partitions, but it reads 4 + 4 + 4 * head_size bytes per partition, against a partition's
// 2 * 64 * head_size * sizeof(T) bytes of cache.
// NOTE: 4 CUDA blocks per SM, from the H200's partition sweep (benchmarks/RESULTS.md): batch 1,
// 32 heads of 128, at 1,024 / 4,096 / 16,384 tokens the fastest partitions were 64 / 128 / 512
// tokens (11.5 / 24.1 / 69.0 us), which is what 4 per SM chooses; 8 per SM chose 64 / 64 / 256
// (11.5 / 26.7 / 73.0 us).
constexpr int MIN_PARTITION_SIZE = 64;
constexpr int V2_BLOCKS_PER_SM = 4;

// A sliding window: the partitions before the one that holds the window's first position
// (`visible`, first_visible) lie wholly before the window. Their CUDA blocks return at once,
// write no results and are not counted: the reduce combines partitions seen_from .. the last
// only, so no partition with no token (maximum -FLT_MAX, sum 0) enters the weights. The grid
// keeps every partition of the longest context (the plan does not know the windows).
__device__ __forceinline__ int first_seen_partition(int visible, int partition_size) {
  return visible / partition_size;
}

// ---- combining the partitions -------------------------------------------------------------
// Softmax over the whole context from the partitions' softmaxes: with m = max_p max_logits[p]
// and weight[p] = exp_sums[p] * exp(max_logits[p] - m), the output is
// sum_p weight[p] * tmp_out[p] / sum_p weight[p]. The pointers are this (sequence, head)'s
// partition 0; weights[num_partitions] and red_smem[2 * NUM_WARPS] are shared memory.
// Run by V2's reduce kernel (a launch of its own) and by the fused reduce (the last partition's
// CUDA block, FROM_L2: see `load_partition_result`).
template <bool FROM_L2>
__device__ __forceinline__ float load_partition_result(const float* p) {
  // The fused reduce reads what *other* CUDA blocks of the same launch wrote, maybe on other
  // SMs: from L2 (ld.global.cg), past this SM's L1, which is not kept coherent with their
  // writes. (A cache line of the workspace holds several (sequence, head)s' results, so this SM
  // may have read the line before they were all written.)
  if constexpr (FROM_L2) return __ldcg(p);
  return *p;
}

template <typename T, int HEAD_SIZE, int NUM_THREADS, bool FROM_L2>
__device__ __forceinline__ void combine_partitions(
    T* out_row, const float* max_logits, const float* exp_sums, const float* tmp_out,
    int num_partitions, float* weights, float* red_smem) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  float m = -FLT_MAX;
  for (int p = threadIdx.x; p < num_partitions; p += NUM_THREADS) {
    m = fmaxf(m, load_partition_result<FROM_L2>(max_logits + p));
  }
  m = block_reduce<NUM_WARPS, 1>(m, red_smem, -FLT_MAX, MaxOp());
  float total = 0.f;
  for (int p = threadIdx.x; p < num_partitions; p += NUM_THREADS) {
    const float w = load_partition_result<FROM_L2>(exp_sums + p) *
                    expf(load_partition_result<FROM_L2>(max_logits + p) - m);
    weights[p] = w;
    total += w;
  }
  // The barrier inside block_reduce also makes every weight visible to every thread.
  total = block_reduce<NUM_WARPS, 1>(total, red_smem + NUM_WARPS, 0.f, SumOp());
  const float inv_total = 1.f / total;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) {
    float sum = 0.f;
    for (int p = 0; p < num_partitions; ++p) {
      sum += weights[p] * load_partition_result<FROM_L2>(tmp_out + p * HEAD_SIZE + d);
    }
    out_row[d] = from_float<T>(sum * inv_total);
  }
}

// ---- the fused reduce ---------------------------------------------------------------------
// Instead of a second kernel, each partition's CUDA block counts itself done on its (sequence,
// head)'s counter (an int in the workspace, zeroed before the launch); the block that brings the
// count to the sequence's own number of partitions runs `combine_partitions` on the results the
// others left in the workspace, and sets the counter back to 0. Partitions at or past a shorter
// context never start, so they never count: the target is the sequence's own partitions. What
// the reduce kernel writes for an empty or broken context, partition 0's block writes instead.
// The weights go to the finished block's logits buffer (PARTITION_SIZE floats, free once
// `attend` is done): more partitions than that run the separate reduce (make_plan).
//
// Returns, in every thread, whether this block finished last. Every thread's writes to the
// workspace are fenced (visible to the whole GPU) before thread 0 counts the block, and thread
// 0 fences again once it sees it finished last, before any thread reads the others' results.
__device__ __forceinline__ bool finished_last(int* counter, int num_partitions, int* last_smem) {
  __threadfence();
  __syncthreads();  // every thread's results are out before the block is counted
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(counter, 1) == num_partitions - 1;
    if (last) {
      __threadfence();
      *counter = 0;  // every partition has counted: ready for the next call
    }
    *last_smem = last;
  }
  __syncthreads();
  return *last_smem != 0;
}

// Partition p of a sequence covers tokens [p * partition_size, (p + 1) * partition_size) of its
// context (partition_size: PARTITION_SIZE or a power-of-two fraction of it, at least
// MIN_PARTITION_SIZE). Writes, for partition p, max_logits[seq, head, p], exp_sums[seq, head, p]
// and the partition's own softmax-weighted values tmp_out[seq, head, p, :] (fp32). With the fused
// reduce (`counters` not null) the last block of a (sequence, head) also writes out[seq, head].
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, typename C = T>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v2_kernel(
    float* __restrict__ max_logits,       // [num_seqs, num_heads, max_partitions]
    float* __restrict__ exp_sums,         // [num_seqs, num_heads, max_partitions]
    float* __restrict__ tmp_out,          // [num_seqs, num_heads, max_partitions, HEAD_SIZE]
    T* __restrict__ out,                  // fused reduce: [num_seqs, num_heads, HEAD_SIZE]
    int* __restrict__ counters,           // fused reduce: [num_seqs, num_heads], zeroed; or null
    const T* __restrict__ query, const C* __restrict__ key_cache,
    const C* __restrict__ value_cache, const KernelArgs a, const int partition_size) {
  static_assert(MIN_PARTITION_SIZE % BLOCK_SIZE == 0, "a partition is whole KV blocks");
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  const int head = blockIdx.x;
  const int num_heads = gridDim.x;
  const int seq = blockIdx.y;
  const int partition = blockIdx.z;
  const int max_partitions = gridDim.z;
  const int kv_head = head / (num_heads / a.num_kv_heads);
  const int context_len = a.context_lens[seq];
  const int num_partitions = (context_len + partition_size - 1) / partition_size;
  const int64_t first = ((int64_t)seq * num_heads + head) * max_partitions;  // partition 0's slot
  if (counters != nullptr && (context_len <= 0 || num_partitions > max_partitions)) {
    // The fused reduce: no reduce kernel follows to write an empty or broken context's row
    // (see fill_row), so partition 0's block does. Uniform over the CUDA block.
    if (partition == 0) {
      fill_row<T, HEAD_SIZE, NUM_THREADS>(out + ((int64_t)seq * num_heads + head) * HEAD_SIZE,
                                          context_len == 0 ? 0.f : quiet_nan());
    }
    return;
  }
  const int partition_start = partition * partition_size;
  // This sequence has fewer partitions than the longest one (or an empty context, for which the
  // reduce kernel writes zeros), or this partition lies wholly before its sliding window:
  // nothing to do, and the reduce skips it (see first_seen_partition). Uniform over the block.
  const int visible = first_visible(context_len, a.window);
  const int seen_from = first_seen_partition(visible, partition_size);
  if (partition_start >= context_len || partition < seen_from) return;
  const int end = context_len - partition_start < partition_size ? context_len
                                                                 : partition_start + partition_size;
  // the window's first block, if it is in this partition
  const int window_block = visible / BLOCK_SIZE * BLOCK_SIZE;
  const int start = window_block > partition_start ? window_block : partition_start;

  __shared__ float logits[PARTITION_SIZE];  // the largest partition's
  __shared__ __align__(16) float q_smem[HEAD_SIZE];
  __shared__ float red_smem[2 * NUM_WARPS];
  __shared__ float out_smem[NUM_WARPS * HEAD_SIZE];
  __shared__ int finished_last_smem;  // the fused reduce: this block finished last

  const PartitionStats stats = attend<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, C>(
      query + seq * a.q_seq_stride + head * a.q_head_stride,
      key_cache + kv_head * a.k_head_stride, value_cache + kv_head * a.v_head_stride,
      a.block_tables + (int64_t)seq * a.max_blocks_per_seq, start, end, visible,
      a.k_block_stride, a.v_block_stride, a.scale, logits, q_smem, red_smem, out_smem,
      code_scales<BLOCK_SIZE>(a, kv_head));
  const int64_t slot = first + partition;
  if (threadIdx.x == 0) {
    max_logits[slot] = stats.max_logit;
    exp_sums[slot] = stats.exp_sum;
  }
  write_output<float, HEAD_SIZE, NUM_THREADS>(tmp_out + slot * HEAD_SIZE, out_smem);

  if (counters == nullptr ||
      !finished_last(counters + (int64_t)seq * num_heads + head, num_partitions - seen_from,
                     &finished_last_smem)) {
    return;
  }
  // The last of this (sequence, head)'s partitions: combine them, the weights in `logits`.
  const int64_t seen = first + seen_from;  // the first partition that ran
  combine_partitions<T, HEAD_SIZE, NUM_THREADS, true>(
      out + ((int64_t)seq * num_heads + head) * HEAD_SIZE, max_logits + seen, exp_sums + seen,
      tmp_out + seen * HEAD_SIZE, num_partitions - seen_from, logits, red_smem);
}

// V2's separate reduce: one CUDA block per (head, sequence) runs `combine_partitions`.
template <typename T, int HEAD_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v2_reduce_kernel(
    T* __restrict__ out,                  // [num_seqs, num_heads, HEAD_SIZE]
    const float* __restrict__ max_logits, const float* __restrict__ exp_sums,
    const float* __restrict__ tmp_out, const int* __restrict__ context_lens,
    int max_partitions, int partition_size, int window) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  const int head = blockIdx.x;
  const int num_heads = gridDim.x;
  const int seq = blockIdx.y;
  const int context_len = context_lens[seq];
  T* out_row = out + ((int64_t)seq * num_heads + head) * HEAD_SIZE;
  const int num_partitions = (context_len + partition_size - 1) / partition_size;

  extern __shared__ float weights[];  // [max_partitions]
  __shared__ float red_smem[2 * NUM_WARPS];

  if (context_len <= 0 || num_partitions > max_partitions) {
    // No partition ran for an empty context: zeros. Negative or too long: NaN (see fill_row).
    fill_row<T, HEAD_SIZE, NUM_THREADS>(out_row, context_len == 0 ? 0.f : quiet_nan());
    return;
  }
  // the partitions that ran: those wholly before a sliding window wrote nothing
  const int seen_from = first_seen_partition(first_visible(context_len, window), partition_size);
  const int64_t seen = ((int64_t)seq * num_heads + head) * max_partitions + seen_from;
  combine_partitions<T, HEAD_SIZE, NUM_THREADS, false>(
      out_row, max_logits + seen, exp_sums + seen, tmp_out + seen * HEAD_SIZE,
      num_partitions - seen_from, weights, red_smem);
}

// ----------------------------------------------------------------------------------------------
// Grouped-query attention (version 3): one CUDA block per (kv head, sequence, partition) serves
// every query head of the kv head's group
// ----------------------------------------------------------------------------------------------
// With GQA the num_heads / num_kv_heads = GROUP query heads of a group read the same keys and
// values. V1 and V2 give each query head a CUDA block of its own, so each key and value is
// loaded GROUP times (docs/ARCHITECTURE.md: the C++ CPU op already reads it once). Here one CUDA
// block takes the whole group: the same four phases as `attend`, with GROUP rows where `attend`
// has one.
//   phase 1  the GROUP queries -> q_smem[GROUP][HEAD_SIZE] (fp32)
//   phase 2  each lane loads its key chunks once (OwnKeyChunks) and multiplies them by each of
//            the GROUP queries: GROUP butterflies, logits[GROUP][partition]
//   phase 3  one softmax per query head (the reductions of `attend`, GROUP times)
//   phase 4  each lane loads a 16-byte slice of a value row once and adds it to GROUP
//            accumulators, one per query head; GROUP outputs leave through out_smem
// A partition's results go to V2's workspace, one slot per *query* head, and V2's reduce kernel
// combines them. When one partition holds every context of the batch, the kernel writes the
// outputs itself (`out` not null, no workspace) and there is nothing to combine. With the fused
// reduce (`counters` not null) one counter per (sequence, kv head) counts the partitions' CUDA
// blocks, and the last one combines the partitions of all GROUP query heads, one after another.
constexpr int MAX_GROUP = 8;  // query heads per kv head: registers hold MAX_GROUP accumulators

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_grouped_kernel(
    T* __restrict__ out,                  // [num_seqs, num_heads, HEAD_SIZE] or null (partitions)
    float* __restrict__ max_logits,       // [num_seqs, num_heads, max_partitions] or null
    float* __restrict__ exp_sums,         // [num_seqs, num_heads, max_partitions] or null
    float* __restrict__ tmp_out,          // [num_seqs, num_heads, max_partitions, HEAD_SIZE]
    int* __restrict__ counters,           // fused reduce: [num_seqs, num_kv_heads], zeroed; or null
    const T* __restrict__ query, const T* __restrict__ key_cache,
    const T* __restrict__ value_cache, const KernelArgs a, const int num_heads,
    const int partition_size, const int max_context_len) {
  static_assert(MIN_PARTITION_SIZE % BLOCK_SIZE == 0, "a partition is whole KV blocks");
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  constexpr int X = Vec16<T>::N;
  constexpr int G = BLOCK_SIZE < WARP_SIZE ? WARP_SIZE / BLOCK_SIZE : 1;  // lanes per token
  constexpr int V_VEC = X;
  constexpr int V_VECS_PER_ROW = BLOCK_SIZE / V_VEC;
  constexpr int ROWS_PER_PASS = WARP_SIZE / V_VECS_PER_ROW;
  constexpr int ROWS_PER_LANE = (HEAD_SIZE + ROWS_PER_PASS - 1) / ROWS_PER_PASS;
  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int partition = blockIdx.z;
  const int max_partitions = gridDim.z;
  const int group = num_heads / a.num_kv_heads;  // query heads kv_head * group + h, h < group
  const int first_head = kv_head * group;
  const int context_len = a.context_lens[seq];
  const int warp = threadIdx.x / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  auto out_row = [&](int h) {
    return out + ((int64_t)seq * num_heads + first_head + h) * HEAD_SIZE;
  };

  const bool fused = counters != nullptr;
  const int num_partitions = (context_len + partition_size - 1) / partition_size;
  // Broken: a negative context, or one longer than the kernel can take (one partition: longer
  // than max_context_len; the fused reduce: more partitions than the grid has, as V2's reduce).
  const bool broken = context_len < 0 || (fused ? num_partitions > max_partitions
                                                : context_len > max_context_len);
  if (out != nullptr && (context_len == 0 || broken)) {
    // One partition or the fused reduce: no reduce kernel follows, so the empty and broken
    // contexts of fill_row are written here, by partition 0's block.
    if (partition == 0) {
      for (int h = 0; h < group; ++h) {
        fill_row<T, HEAD_SIZE, NUM_THREADS>(out_row(h), context_len == 0 ? 0.f : quiet_nan());
      }
    }
    return;
  }
  const int partition_start = partition * partition_size;
  // as in V2: past a shorter context, or wholly before the sliding window, nothing to do
  const int visible = first_visible(context_len, a.window);
  const int seen_from = first_seen_partition(visible, partition_size);
  if (partition_start >= context_len || partition < seen_from) return;
  const int end = context_len - partition_start < partition_size ? context_len
                                                                 : partition_start + partition_size;
  // the window's first block, if it is in this partition (`attend`'s masking, below)
  const int window_block = visible / BLOCK_SIZE * BLOCK_SIZE;
  const int start = window_block > partition_start ? window_block : partition_start;
  const int first_valid = visible - start;  // tokens before it (from `start`) left the window
  const int first_block = start / BLOCK_SIZE;
  const int num_blocks = (end - start + BLOCK_SIZE - 1) / BLOCK_SIZE;
  const int num_tokens = end - start;
  const int* block_table = a.block_tables + (int64_t)seq * a.max_blocks_per_seq;
  const T* keys = key_cache + kv_head * a.k_head_stride;
  const T* values = value_cache + kv_head * a.v_head_stride;

  __shared__ float logits[MAX_GROUP * PARTITION_SIZE];        // head h at h * PARTITION_SIZE
  __shared__ __align__(16) float q_smem[MAX_GROUP * HEAD_SIZE];
  __shared__ float red_smem[MAX_GROUP * 2 * NUM_WARPS];        // each head's own slots
  __shared__ float out_smem[MAX_GROUP * NUM_WARPS * HEAD_SIZE];  // head h, warp w: row h*4+w
  __shared__ int finished_last_smem;  // the fused reduce: this block finished last

  // ---- phase 1: the group's queries into shared memory -------------------------------------
  for (int i = threadIdx.x; i < group * HEAD_SIZE; i += NUM_THREADS) {
    const int h = i / HEAD_SIZE, d = i % HEAD_SIZE;
    q_smem[i] = to_float(query[seq * a.q_seq_stride + (first_head + h) * a.q_head_stride + d]);
  }
  __syncthreads();

  // ---- phase 2: each key loaded once, multiplied by every query of the group ------------------
  const int token_in_block = lane / G;
  const int lane_in_group = lane % G;
  float qk_max[MAX_GROUP];
#pragma unroll
  for (int h = 0; h < MAX_GROUP; ++h) qk_max[h] = -FLT_MAX;
  for (int b = warp; b < num_blocks; b += NUM_WARPS) {
    const int64_t physical_block = block_table[first_block + b];
    MP_TRACE(TRACE_VISIT, first_block + b, physical_block, 0);
    OwnKeyChunks<T, HEAD_SIZE, BLOCK_SIZE> key;
    key.load(keys + physical_block * a.k_block_stride + token_in_block * X, lane_in_group);
    const int token = b * BLOCK_SIZE + token_in_block;  // from `start`
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h) {
      if (h < group) {  // uniform over the warp: the butterfly's lanes all take part
        const float partial = key.dot(q_smem + h * HEAD_SIZE, lane_in_group);
        float qk = a.scale * butterfly<G / 2, 1>(partial, SumOp());
        if (token < num_tokens) {
          if (token < first_valid) qk = -FLT_MAX;  // left the window (see `attend`)
          if (lane_in_group == 0) {
            logits[h * PARTITION_SIZE + token] = qk;
            MP_TRACE(TRACE_LOGIT, start + token, h, qk);
          }
          qk_max[h] = fmaxf(qk_max[h], qk);
        }
      }
    }
  }

  // ---- phase 3: one softmax per query head ----------------------------------------------------
  // `attend`'s two reductions for each head, each in its own red_smem slots. The first barrier
  // (in the first block_reduce) also makes every head's logits visible to every thread.
  // NOTE: written again here rather than shared with `attend`: attend's phase 3 is lesson 06's
  // exercise (the learner's code replaces those lines, between the softmax_phase markers).
  PartitionStats stats[MAX_GROUP];
#pragma unroll
  for (int h = 0; h < MAX_GROUP; ++h) {
    if (h < group) {  // uniform over the CUDA block: every thread meets the barriers
      float* head_logits = logits + h * PARTITION_SIZE;
      float* red = red_smem + h * 2 * NUM_WARPS;
      const float max_logit = block_reduce<NUM_WARPS, G>(qk_max[h], red, -FLT_MAX, MaxOp());
      MP_TRACE(TRACE_MAX, h, 0, max_logit);
      float exp_sum = 0.f;
      for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) {
        const float e = expf(head_logits[i] - max_logit);
        head_logits[i] = e;
        exp_sum += e;
      }
      exp_sum = block_reduce<NUM_WARPS, 1>(exp_sum, red + NUM_WARPS, 0.f, SumOp());
      MP_TRACE(TRACE_EXP_SUM, h, 0, exp_sum);
      const float inv_sum = 1.f / exp_sum;
      for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) head_logits[i] *= inv_sum;
      stats[h] = {max_logit, exp_sum};
    }
  }
  __syncthreads();  // every probability of every head is written before phase 4 reads them

  // ---- phase 4: each value slice loaded once, added to every head's output --------------------
  // The lanes' rows and slices are `attend`'s; acc[h][i] is row i of this lane for query head h.
  const int row_in_pass = lane / V_VECS_PER_ROW;
  const int slice = lane % V_VECS_PER_ROW;
  float acc[MAX_GROUP][ROWS_PER_LANE];
#pragma unroll
  for (int h = 0; h < MAX_GROUP; ++h) {
#pragma unroll
    for (int i = 0; i < ROWS_PER_LANE; ++i) acc[h][i] = 0.f;
  }
  for (int b = warp; b < num_blocks; b += NUM_WARPS) {
    const int64_t physical_block = block_table[first_block + b];
    const T* v = values + physical_block * a.v_block_stride + slice * V_VEC;
    const int first_token = b * BLOCK_SIZE + slice * V_VEC;  // from `start`
    // the slice's probabilities for every head; 0 past the range (see `attend`)
    float probs[MAX_GROUP][V_VEC];
#pragma unroll
    for (int h = 0; h < MAX_GROUP; ++h) {
#pragma unroll
      for (int j = 0; j < V_VEC; ++j) {
        probs[h][j] = h < group && first_token + j < num_tokens
                          ? logits[h * PARTITION_SIZE + first_token + j] : 0.f;
      }
    }
#pragma unroll
    for (int i = 0; i < ROWS_PER_LANE; ++i) {
      const int row = row_in_pass + i * ROWS_PER_PASS;
      if (row < HEAD_SIZE) {
        float vals[V_VEC];  // loaded once for the whole group
        load_value_slice<T>(v + row * BLOCK_SIZE, first_token, first_valid, num_tokens, vals);
#pragma unroll
        for (int h = 0; h < MAX_GROUP; ++h) {
          if (h < group) {
#pragma unroll
            for (int j = 0; j < V_VEC; ++j) acc[h][i] += probs[h][j] * vals[j];
          }
        }
      }
    }
  }
  // As in `attend`: a butterfly adds up the lanes that share a row, then the first lane of each
  // row team writes the warp's row sums, head by head.
#pragma unroll
  for (int h = 0; h < MAX_GROUP; ++h) {
    if (h < group) {
#pragma unroll
      for (int i = 0; i < ROWS_PER_LANE; ++i) {
        const float sum = butterfly<V_VECS_PER_ROW / 2, 1>(acc[h][i], SumOp());
        const int row = row_in_pass + i * ROWS_PER_PASS;
        if (slice == 0 && row < HEAD_SIZE) out_smem[(h * NUM_WARPS + warp) * HEAD_SIZE + row] = sum;
      }
    }
  }
  __syncthreads();

  // One partition: the outputs themselves. Else V2's workspace, one slot per query head.
  auto first_slot = [&](int h) {  // query head h's partition 0 in the workspace
    return ((int64_t)seq * num_heads + first_head + h) * max_partitions;
  };
#pragma unroll
  for (int h = 0; h < MAX_GROUP; ++h) {
    if (h >= group) break;
    const float* head_out = out_smem + h * NUM_WARPS * HEAD_SIZE;
    if (max_logits == nullptr) {
      write_output<T, HEAD_SIZE, NUM_THREADS>(out_row(h), head_out);
      continue;
    }
    const int64_t slot = first_slot(h) + partition;
    if (threadIdx.x == 0) {
      max_logits[slot] = stats[h].max_logit;
      exp_sums[slot] = stats[h].exp_sum;
    }
    write_output<float, HEAD_SIZE, NUM_THREADS>(tmp_out + slot * HEAD_SIZE, head_out);
  }

  if (!fused || !finished_last(counters + (int64_t)seq * a.num_kv_heads + kv_head,
                               num_partitions - seen_from, &finished_last_smem)) {
    return;
  }
  // The last of this (sequence, kv head)'s partitions: combine each query head's, its weights
  // in its own logits rows and its own reduction slots (from the first partition that ran).
  for (int h = 0; h < group; ++h) {
    const int64_t seen = first_slot(h) + seen_from;
    combine_partitions<T, HEAD_SIZE, NUM_THREADS, true>(
        out_row(h), max_logits + seen, exp_sums + seen, tmp_out + seen * HEAD_SIZE,
        num_partitions - seen_from, logits + h * PARTITION_SIZE, red_smem + h * 2 * NUM_WARPS);
  }
}

// ----------------------------------------------------------------------------------------------
// Launch: choose V1, V2 or the grouped kernel, pick the template instance, size the shared
// memory, check errors
// ----------------------------------------------------------------------------------------------
constexpr int NUM_THREADS = 128;
constexpr int MAX_GRID_Y = 65535;      // gridDim.y (sequences) and gridDim.z (partitions)
constexpr int V1_MAX_CONTEXT = 8192;   // V2 above this: V1's logits would crowd shared memory
constexpr int V1_MIN_BLOCKS = 512;     // V1 only when num_seqs * num_heads fills the GPU

// Error codes of the extern "C" functions below (0 = success, > 0 = a cudaError_t).
enum ErrorCode {
  UNSUPPORTED_DTYPE = -1,
  UNSUPPORTED_HEAD_SIZE = -2,
  UNSUPPORTED_BLOCK_SIZE = -3,
  SHARED_MEMORY_TOO_SMALL = -4,  // V1's logits of max_context_len tokens do not fit
  TOO_MANY_SEQUENCES = -5,       // more than MAX_GRID_Y sequences (or partitions)
  MISALIGNED = -6,               // a cache pointer or stride is not a multiple of 16 bytes
  WORKSPACE_TOO_SMALL = -7,
  BAD_HEAD_COUNTS = -8,          // num_heads is not a multiple of num_kv_heads
  BAD_VERSION = -9,
  BAD_PARTITION_SIZE = -10,      // a forced partition size that is no power of two in [64, 512]
  NOT_GROUPED_SHAPE = -11,       // version 3 forced where the grouped kernel is not built
  BAD_REDUCE_MODE = -12,         // minipaged_set_v2_reduce's mode is neither 0 nor 1
  BAD_WINDOW = -13,              // a negative sliding window
};

// Where the grouped kernel (version 3) is built: at most MAX_GROUP query heads per kv head,
// head sizes 64 and 128, a 16- or 32-bit cache (an 8-bit cache runs V1 or V2).
inline bool grouped_kernel_built(int num_heads, int num_kv_heads, int head_size, bool codes) {
  const int group = num_heads / num_kv_heads;
  return !codes && group <= MAX_GROUP && (head_size == 64 || head_size == 128);
}

// The grouped kernel whenever query heads share a kv head and it is built for the shape: it
// reads each key and value once per group instead of once per query head. Otherwise V1 for
// short contexts, or when the batch alone has enough CUDA blocks to fill the GPU, and V2
// (partitions) for the rest. `requested` 1, 2 or 3 forces a version (tests, benchmarks).
inline int choose_version(int num_seqs, int num_heads, int max_context_len, int requested,
                          bool grouped) {
  if (requested != 0) return requested;
  if (grouped) return 3;
  if (max_context_len <= MIN_PARTITION_SIZE) return 1;  // one partition at most: nothing to split
  if (max_context_len <= V1_MAX_CONTEXT && (int64_t)num_seqs * num_heads >= V1_MIN_BLOCKS) return 1;
  return 2;
}

// A partition size every caller may force (benchmarks): 0 = the plan's own choice.
inline std::atomic<int>& forced_partition_size() {
  static std::atomic<int> size{0};
  return size;
}

// How V2 and version 3 combine the partitions, for every caller (benchmarks, tests): a reduce
// kernel of its own (SEPARATE_REDUCE, the default) or the partitions' last CUDA block
// (FUSED_REDUCE, "The fused reduce" above). The fused reduce puts its weights in the logits
// buffer, so it takes at most FUSED_MAX_PARTITIONS partitions; longer contexts keep the
// separate reduce.
// NOTE: the fused reduce saves the second launch and the reduce kernel's wait for the slowest
// partition, but adds a memset of the counters before the launch; off by default until a GPU
// has timed both (benchmarks/kernel.py --partitions).
enum ReduceMode { SEPARATE_REDUCE = 0, FUSED_REDUCE = 1 };
constexpr int FUSED_MAX_PARTITIONS = PARTITION_SIZE;
inline std::atomic<int>& v2_reduce_mode() {
  static std::atomic<int> mode{SEPARATE_REDUCE};
  return mode;
}

// Device facts, queried once per device rather than on every call.
constexpr int MAX_DEVICES = 64;
struct DeviceLimits {
  int error = 0;
  int smem_optin = 0;        // shared memory one block may use after opting in
  int multiprocessors = 0;   // SMs
};
inline const DeviceLimits& device_limits(int device) {
  static DeviceLimits limits[MAX_DEVICES];
  static std::once_flag once[MAX_DEVICES];
  std::call_once(once[device], [device] {
    DeviceLimits& l = limits[device];
    l.error = (int)cudaDeviceGetAttribute(&l.smem_optin,
                                          cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (!l.error) {
      l.error = (int)cudaDeviceGetAttribute(&l.multiprocessors,
                                            cudaDevAttrMultiProcessorCount, device);
    }
  });
  return limits[device];
}

// What runs for a batch: the version and, for V2, the partition size and count.
struct Plan {
  int error = 0;
  int version = 1;
  int partition_size = 0;  // tokens (V2 and version 3)
  int partitions = 0;      // of the longest context (V2 and version 3)
  bool fused_reduce = false;  // the partitions' last CUDA block combines them (no reduce kernel)
};

// What a batch needs: num_seqs sequences of num_heads query heads over num_kv_heads kv heads,
// `codes` for an 8-bit cache. The grouped kernel has one CUDA block per kv head, so the grid it
// fills has num_seqs * num_kv_heads rows.
inline Plan make_plan(int num_seqs, int num_heads, int num_kv_heads, int head_size,
                      int max_context_len, int requested, bool codes) {
  Plan plan;
  const bool grouped = grouped_kernel_built(num_heads, num_kv_heads, head_size, codes);
  if (requested == 3 && !grouped) {
    plan.error = NOT_GROUPED_SHAPE;
    return plan;
  }
  plan.version = choose_version(num_seqs, num_heads, max_context_len, requested,
                                grouped && num_heads > num_kv_heads);
  if (plan.version == 1) return plan;
  int size = forced_partition_size().load();
  if (size == 0) {
    size = PARTITION_SIZE;
    if (requested == 0) {  // forced V2 (or 3) keeps the textbook 512 tokens (lesson 06)
      int device = 0;
      plan.error = (int)cudaGetDevice(&device);
      if (!plan.error && (device < 0 || device >= MAX_DEVICES)) {
        plan.error = (int)cudaErrorInvalidDevice;
      }
      if (plan.error) return plan;
      const DeviceLimits& limits = device_limits(device);
      if ((plan.error = limits.error)) return plan;
      const int64_t target = (int64_t)V2_BLOCKS_PER_SM * limits.multiprocessors;
      const int64_t rows = (int64_t)num_seqs * (plan.version == 3 ? num_kv_heads : num_heads);
      while (size > MIN_PARTITION_SIZE &&
             rows * ((max_context_len + size - 1) / size) < target) {
        size /= 2;
      }
    }
  }
  plan.partition_size = size;
  plan.partitions = (max_context_len + size - 1) / size;
  // (version 3 with one partition writes the outputs itself: there is nothing to combine)
  plan.fused_reduce = v2_reduce_mode().load() == FUSED_REDUCE &&
                      plan.partitions <= FUSED_MAX_PARTITIONS &&
                      !(plan.version == 3 && plan.partitions == 1);
  return plan;
}

// V2's scratch: max_logits and exp_sums [num_seqs, num_heads, P] then tmp_out [..., P, head_size],
// then, with the fused reduce, its counters: num_seqs * num_heads int32s in float-sized slots
// (V2 counts per (sequence, head), version 3 per (sequence, kv head): fewer).
// (The grouped kernel needs none when one partition holds every context: it writes the output.)
inline int64_t fused_counters(int num_seqs, int num_heads, const Plan& plan) {
  return plan.fused_reduce ? (int64_t)num_seqs * num_heads : 0;
}
inline int64_t workspace_floats(int num_seqs, int num_heads, int head_size, const Plan& plan) {
  if (plan.version == 1 || (plan.version == 3 && plan.partitions == 1)) return 0;
  return (int64_t)num_seqs * num_heads * plan.partitions * (2 + head_size) +
         fused_counters(num_seqs, num_heads, plan);
}
static_assert(sizeof(int) == sizeof(float), "a counter takes one float's slot");


// Static shared memory of a kernel, and permission to use all the rest dynamically (a kernel
// must opt in above 48 KiB of static + dynamic shared memory). Done once per kernel and device.
struct KernelSmem {
  int error = 0;
  size_t static_bytes = 0;
  size_t max_dynamic = 0;
};
// (A template on the kernel itself: kernels of one dtype share a function type.)
template <auto kernel>
const KernelSmem& kernel_smem() {
  static KernelSmem smem[MAX_DEVICES];
  static std::once_flag once[MAX_DEVICES];
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess || device < 0 || device >= MAX_DEVICES) {
    static KernelSmem failed;
    failed.error = err != cudaSuccess ? (int)err : (int)cudaErrorInvalidDevice;
    return failed;
  }
  std::call_once(once[device], [device] {
    KernelSmem& s = smem[device];
    const DeviceLimits& limits = device_limits(device);
    cudaFuncAttributes attrs;
    s.error = limits.error ? limits.error : (int)cudaFuncGetAttributes(&attrs, kernel);
    if (s.error) return;
    s.static_bytes = attrs.sharedSizeBytes;
    s.max_dynamic = limits.smem_optin > (int)attrs.sharedSizeBytes
                        ? limits.smem_optin - attrs.sharedSizeBytes : 0;
    s.error = (int)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)s.max_dynamic);
  });
  return smem[device];
}

struct AttentionArgs {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  int num_seqs, num_heads, head_size, max_context_len;
  Plan plan;
  float* workspace;
  int64_t workspace_floats;
  cudaStream_t stream;
  KernelArgs k;
};

// The launch error of *this* launch: an error left pending by an earlier call is cleared before
// launching (it was that call's to report), and the launch is checked right after.
inline void clear_stale_error() { (void)cudaGetLastError(); }
inline int launch_error() { return (int)cudaGetLastError(); }

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, typename C = T>
int launch_v1(const AttentionArgs& a) {
  constexpr auto kernel = paged_attention_v1_kernel<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, C>;
  const KernelSmem& smem = kernel_smem<kernel>();
  if (smem.error) return smem.error;
  // One fp32 logit per token, rounded up to whole blocks (phase 4 reads block by block).
  const int capacity = (a.max_context_len + BLOCK_SIZE - 1) / BLOCK_SIZE * BLOCK_SIZE;
  const size_t dynamic_smem = (size_t)capacity * sizeof(float);
  if (dynamic_smem > smem.max_dynamic) return SHARED_MEMORY_TOO_SMALL;
  const dim3 grid(a.num_heads, a.num_seqs);
  clear_stale_error();
  kernel<<<grid, NUM_THREADS, dynamic_smem, a.stream>>>(
      static_cast<T*>(a.out), static_cast<const T*>(a.query),
      static_cast<const C*>(a.key_cache), static_cast<const C*>(a.value_cache), a.k, capacity);
  return launch_error();
}

// V2's workspace cut into its three arrays and the fused reduce's counters (see
// workspace_floats), once checked for size.
struct PartitionResults {
  int error = 0;
  float* max_logits = nullptr;
  float* exp_sums = nullptr;
  float* tmp_out = nullptr;
  int* counters = nullptr;  // null: the separate reduce
};
template <typename T, int HEAD_SIZE>
PartitionResults partition_results(const AttentionArgs& a) {
  PartitionResults r;
  constexpr auto reduce = paged_attention_v2_reduce_kernel<T, HEAD_SIZE, NUM_THREADS>;
  const KernelSmem& reduce_smem = kernel_smem<reduce>();
  if (a.plan.partitions > MAX_GRID_Y) {
    r.error = TOO_MANY_SEQUENCES;
  } else if (a.workspace_floats < workspace_floats(a.num_seqs, a.num_heads, HEAD_SIZE, a.plan)) {
    r.error = WORKSPACE_TOO_SMALL;
  } else if (reduce_smem.error) {
    r.error = reduce_smem.error;
  } else if ((size_t)a.plan.partitions * sizeof(float) > reduce_smem.max_dynamic) {
    r.error = SHARED_MEMORY_TOO_SMALL;
  }
  const int64_t stats = (int64_t)a.num_seqs * a.num_heads * a.plan.partitions;
  r.max_logits = a.workspace;
  r.exp_sums = r.max_logits + stats;
  r.tmp_out = r.exp_sums + stats;
  if (a.plan.fused_reduce) r.counters = reinterpret_cast<int*>(r.tmp_out + stats * HEAD_SIZE);
  return r;
}

// The fused reduce's counters start at 0 on every call: the workspace is fresh memory (and a
// call that failed half-way may have left counts behind). On the launch's stream, so a CUDA
// graph captures it as a memset node before the kernel.
inline int zero_counters(const AttentionArgs& a, const PartitionResults& r) {
  if (r.counters == nullptr) return 0;
  const size_t bytes = (size_t)fused_counters(a.num_seqs, a.num_heads, a.plan) * sizeof(int);
  return (int)cudaMemsetAsync(r.counters, 0, bytes, a.stream);
}

// V2's second kernel: one CUDA block per (head, sequence) combines the partitions.
template <typename T, int HEAD_SIZE>
int launch_reduce(const AttentionArgs& a, const PartitionResults& r) {
  constexpr auto reduce = paged_attention_v2_reduce_kernel<T, HEAD_SIZE, NUM_THREADS>;
  const size_t weights_smem = (size_t)a.plan.partitions * sizeof(float);
  reduce<<<dim3(a.num_heads, a.num_seqs), NUM_THREADS, weights_smem, a.stream>>>(
      static_cast<T*>(a.out), r.max_logits, r.exp_sums, r.tmp_out, a.k.context_lens,
      a.plan.partitions, a.plan.partition_size, a.k.window);
  return launch_error();
}

// The partitions, then the reduce kernel; or, with the fused reduce, the counters' memset and
// the partitions alone. (An 8-bit cache, C, takes the same paths.)
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, typename C = T>
int launch_v2(const AttentionArgs& a) {
  const PartitionResults r = partition_results<T, HEAD_SIZE>(a);
  if (r.error) return r.error;
  constexpr auto kernel = paged_attention_v2_kernel<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, C>;
  if (const int err = zero_counters(a, r)) return err;
  clear_stale_error();
  kernel<<<dim3(a.num_heads, a.num_seqs, a.plan.partitions), NUM_THREADS, 0, a.stream>>>(
      r.max_logits, r.exp_sums, r.tmp_out, r.counters ? static_cast<T*>(a.out) : nullptr,
      r.counters, static_cast<const T*>(a.query), static_cast<const C*>(a.key_cache),
      static_cast<const C*>(a.value_cache), a.k, a.plan.partition_size);
  const int err = launch_error();
  return err || r.counters ? err : launch_reduce<T, HEAD_SIZE>(a, r);
}

// Version 3: one CUDA block per (kv head, sequence, partition); with one partition it writes
// the outputs and no reduce kernel runs; with the fused reduce neither does one.
template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
int launch_grouped(const AttentionArgs& a) {
  constexpr auto kernel = paged_attention_grouped_kernel<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>;
  const bool one_partition = a.plan.partitions == 1;
  const PartitionResults r =
      one_partition ? PartitionResults{} : partition_results<T, HEAD_SIZE>(a);
  if (r.error) return r.error;
  if (const int err = zero_counters(a, r)) return err;
  const bool writes_out = one_partition || r.counters != nullptr;
  clear_stale_error();
  kernel<<<dim3(a.k.num_kv_heads, a.num_seqs, a.plan.partitions), NUM_THREADS, 0, a.stream>>>(
      writes_out ? static_cast<T*>(a.out) : nullptr, r.max_logits, r.exp_sums, r.tmp_out,
      r.counters, static_cast<const T*>(a.query), static_cast<const T*>(a.key_cache),
      static_cast<const T*>(a.value_cache), a.k, a.num_heads, a.plan.partition_size,
      a.max_context_len);
  const int err = launch_error();
  return err || writes_out ? err : launch_reduce<T, HEAD_SIZE>(a, r);
}

// ---- one switch for every (dtype, head size, block size) the kernels are built for ------------
// A test build may define MINIPAGED_FEW_INSTANCES to compile head size 64 and block size 16 only
// (the sanitizer programs do: they then compile in seconds).
template <typename T>
struct Type {
  using type = T;
};
template <int N>
using Int = std::integral_constant<int, N>;

template <typename T, int HEAD_SIZE, typename F>
int dispatch_block_size(int block_size, F& f) {
  switch (block_size) {
    case 16: return f(Type<T>(), Int<HEAD_SIZE>(), Int<16>());
#ifndef MINIPAGED_FEW_INSTANCES
    case 8: return f(Type<T>(), Int<HEAD_SIZE>(), Int<8>());
    case 32: return f(Type<T>(), Int<HEAD_SIZE>(), Int<32>());
#endif
    default: return UNSUPPORTED_BLOCK_SIZE;
  }
}

template <typename T, typename F>
int dispatch_head_size(int head_size, int block_size, F& f) {
  switch (head_size) {
    case 64: return dispatch_block_size<T, 64>(block_size, f);
#ifndef MINIPAGED_FEW_INSTANCES
    case 80: return dispatch_block_size<T, 80>(block_size, f);
    case 96: return dispatch_block_size<T, 96>(block_size, f);
    case 112: return dispatch_block_size<T, 112>(block_size, f);
    case 128: return dispatch_block_size<T, 128>(block_size, f);
    case 256: return dispatch_block_size<T, 256>(block_size, f);
#endif
    default: return UNSUPPORTED_HEAD_SIZE;
  }
}

// f(Type<T>, Int<HEAD_SIZE>, Int<BLOCK_SIZE>) for dtype 0 = float32, 1 = float16, 2 = bfloat16.
template <typename F>
int dispatch(int dtype, int head_size, int block_size, F f) {
  switch (dtype) {
    case 0: return dispatch_head_size<float>(head_size, block_size, f);
    case 1: return dispatch_head_size<__half>(head_size, block_size, f);
    case 2: return dispatch_head_size<__nv_bfloat16>(head_size, block_size, f);
    default: return UNSUPPORTED_DTYPE;
  }
}

// An 8-bit cache (lesson 18): f(Type<T>, Type<C>, Int<HEAD_SIZE>, Int<BLOCK_SIZE>) for the query's
// dtype (as above) and cache_dtype 3 = int8, 4 = fp8 e4m3. Built for head sizes 64 and 128 and
// block sizes 16 and 32 only: phase 4 reads a value row 16 codes (16 tokens) at a time.
template <typename T, typename C, typename F>
int dispatch_8bit_shape(int head_size, int block_size, F& f) {
  auto blocks = [&](auto head) {
    switch (block_size) {
      case 16: return f(Type<T>(), Type<C>(), head, Int<16>());
#ifndef MINIPAGED_FEW_INSTANCES
      case 32: return f(Type<T>(), Type<C>(), head, Int<32>());
#endif
      default: return (int)UNSUPPORTED_BLOCK_SIZE;
    }
  };
  switch (head_size) {
    case 64: return blocks(Int<64>());
#ifndef MINIPAGED_FEW_INSTANCES
    case 128: return blocks(Int<128>());
#endif
    default: return UNSUPPORTED_HEAD_SIZE;
  }
}

template <typename T, typename F>
int dispatch_8bit_code(int cache_dtype, int head_size, int block_size, F& f) {
  switch (cache_dtype) {
    case 3: return dispatch_8bit_shape<T, int8_t>(head_size, block_size, f);
    case 4: return dispatch_8bit_shape<T, fp8_e4m3>(head_size, block_size, f);
    default: return UNSUPPORTED_DTYPE;
  }
}

template <typename F>
int dispatch_8bit(int dtype, int cache_dtype, int head_size, int block_size, F f) {
  switch (dtype) {
    case 0: return dispatch_8bit_code<float>(cache_dtype, head_size, block_size, f);
    case 1: return dispatch_8bit_code<__half>(cache_dtype, head_size, block_size, f);
    case 2: return dispatch_8bit_code<__nv_bfloat16>(cache_dtype, head_size, block_size, f);
    default: return UNSUPPORTED_DTYPE;
  }
}

// The grouped kernel (version 3): f(Type<T>, Int<HEAD_SIZE>, Int<BLOCK_SIZE>) for head sizes 64
// and 128 only (grouped_kernel_built), every block size and 16/32-bit dtype.
template <typename F>
int dispatch_grouped(int dtype, int head_size, int block_size, F f) {
  auto heads = [&](auto type) {
    using T = typename decltype(type)::type;
    switch (head_size) {
      case 64: return dispatch_block_size<T, 64>(block_size, f);
#ifndef MINIPAGED_FEW_INSTANCES
      case 128: return dispatch_block_size<T, 128>(block_size, f);
#endif
      default: return (int)UNSUPPORTED_HEAD_SIZE;
    }
  };
  switch (dtype) {
    case 0: return heads(Type<float>());
    case 1: return heads(Type<__half>());
    case 2: return heads(Type<__nv_bfloat16>());
    default: return UNSUPPORTED_DTYPE;
  }
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Version 3's launch for any built (dtype, head size, block size): defined in the translation
// unit of the grouped instances (below).
int launch_grouped_any(const AttentionArgs& a, int dtype, int head_size, int block_size);

}  // namespace minipaged

// ---- three translation units ------------------------------------------------------------------
// Every template instance of this file in one nvcc run took 78 s on this project's 2-core machine
// (2026-11-26). The GPU build compiles the file three times, each time instantiating one part:
// this file alone, the entry points of 16- and 32-bit caches (V1, V2); paged_attention_8bit.cu,
// the 8-bit cache's (lesson 18); paged_attention_grouped.cu, version 3. The CPU builds define
// MINIPAGED_ALL_PARTS and take everything from this one file.
#if defined(MINIPAGED_ALL_PARTS)
#define MP_PART_MAIN 1
#define MP_PART_8BIT 1
#define MP_PART_GROUPED 1
#elif defined(MINIPAGED_PART_8BIT)
#define MP_PART_MAIN 0
#define MP_PART_8BIT 1
#define MP_PART_GROUPED 0
#elif defined(MINIPAGED_PART_GROUPED)
#define MP_PART_MAIN 0
#define MP_PART_8BIT 0
#define MP_PART_GROUPED 1
#else
#define MP_PART_MAIN 1
#define MP_PART_8BIT 0
#define MP_PART_GROUPED 0
#endif

#if MP_PART_GROUPED
int minipaged::launch_grouped_any(const AttentionArgs& a, int dtype, int head_size,
                                  int block_size) {
  return dispatch_grouped(dtype, head_size, block_size, [&](auto type, auto head, auto block) {
    using T = typename decltype(type)::type;
    return launch_grouped<T, decltype(head)::value, decltype(block)::value>(a);
  });
}
#endif

#if MP_PART_MAIN

// Which kernel runs for this batch (1, 2 or 3), its partition size in tokens (0 for V1) and the
// bytes of device workspace the caller must pass to minipaged_paged_attention (0 for V1, and for
// version 3 when one partition holds every context). version: 0 = choose (version and partition
// size), 1, 2, 3 = grouped (512-token partitions unless forced). cache_dtype: the dtype codes of
// minipaged_paged_attention, or 3, 4 for an 8-bit cache (minipaged_paged_attention_8bit).
extern "C" int minipaged_paged_attention_plan(int num_seqs, int num_heads, int num_kv_heads,
                                              int head_size, int max_context_len,
                                              int cache_dtype, int version,
                                              int* chosen_version, int* partition_size,
                                              int64_t* workspace_bytes) {
  if (version < 0 || version > 3) return minipaged::BAD_VERSION;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return minipaged::BAD_HEAD_COUNTS;
  const minipaged::Plan plan = minipaged::make_plan(
      num_seqs, num_heads, num_kv_heads, head_size, max_context_len, version, cache_dtype >= 3);
  if (plan.error) return plan.error;
  *chosen_version = plan.version;
  *partition_size = plan.partition_size;
  *workspace_bytes =
      (int64_t)sizeof(float) * minipaged::workspace_floats(num_seqs, num_heads, head_size, plan);
  return 0;
}

// Force V2's partition size for every later call (benchmarks): a power of two from
// MIN_PARTITION_SIZE to PARTITION_SIZE tokens, or 0 to let the plan choose again.
extern "C" int minipaged_force_partition_size(int tokens) {
  if (tokens != 0 && (tokens < minipaged::MIN_PARTITION_SIZE ||
                      tokens > minipaged::PARTITION_SIZE || (tokens & (tokens - 1)))) {
    return minipaged::BAD_PARTITION_SIZE;
  }
  minipaged::forced_partition_size().store(tokens);
  return 0;
}

// How V2 and version 3 combine their partitions in every later call: 0 = a reduce kernel of
// their own (the default), 1 = the fused reduce, in the partitions' last CUDA block (up to
// FUSED_MAX_PARTITIONS partitions; more keep the reduce kernel). The plan's workspace follows.
extern "C" int minipaged_set_v2_reduce(int mode) {
  if (mode != minipaged::SEPARATE_REDUCE && mode != minipaged::FUSED_REDUCE) {
    return minipaged::BAD_REDUCE_MODE;
  }
  minipaged::v2_reduce_mode().store(mode);
  return 0;
}

// Error codes: see minipaged::ErrorCode. dtype: 0 = float32, 1 = float16, 2 = bfloat16.
// The caches must be 16-byte aligned, with block and head strides that keep them so.
extern "C" int minipaged_paged_attention(
    void* out, const void* query, const void* key_cache, const void* value_cache,
    const int* block_tables, const int* context_lens, int num_seqs, int num_heads,
    int num_kv_heads, int head_size, int block_size, int max_blocks_per_seq,
    int64_t q_seq_stride, int64_t q_head_stride, int64_t k_block_stride, int64_t k_head_stride,
    int64_t v_block_stride, int64_t v_head_stride, float scale, int max_context_len, int window,
    int dtype, int version, void* workspace, int64_t workspace_bytes, cudaStream_t stream) {
  if (window < 0) return minipaged::BAD_WINDOW;
  if (num_seqs == 0 || num_heads == 0) return 0;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return minipaged::BAD_HEAD_COUNTS;
  if (num_seqs > minipaged::MAX_GRID_Y) return minipaged::TOO_MANY_SEQUENCES;
  if (version < 0 || version > 3) return minipaged::BAD_VERSION;
  const int element = dtype == 0 ? 4 : 2;
  if (!minipaged::aligned16(key_cache) || !minipaged::aligned16(value_cache) ||
      (k_block_stride * element) % 16 || (k_head_stride * element) % 16 ||
      (v_block_stride * element) % 16 || (v_head_stride * element) % 16) {
    return minipaged::MISALIGNED;
  }
  const minipaged::Plan plan = minipaged::make_plan(
      num_seqs, num_heads, num_kv_heads, head_size, max_context_len, version, false);
  if (plan.error) return plan.error;
  minipaged::KernelArgs k{block_tables, context_lens, max_blocks_per_seq, num_kv_heads,
                          q_seq_stride, q_head_stride, k_block_stride, k_head_stride,
                          v_block_stride, v_head_stride, scale};
  k.window = window;
  const minipaged::AttentionArgs a{
      out, query, key_cache, value_cache, num_seqs, num_heads, head_size, max_context_len, plan,
      static_cast<float*>(workspace), workspace_bytes / (int64_t)sizeof(float), stream, k};
  if (plan.version == 3) return minipaged::launch_grouped_any(a, dtype, head_size, block_size);
  return minipaged::dispatch(dtype, head_size, block_size, [&](auto type, auto head, auto block) {
    using T = typename decltype(type)::type;
    return a.plan.version == 1 ? minipaged::launch_v1<T, decltype(head)::value, decltype(block)::value>(a)
                          : minipaged::launch_v2<T, decltype(head)::value, decltype(block)::value>(a);
  });
}

// V1's shared memory on the current device: its static __shared__ bytes and the longest
// context whose logits still fit (V2 has no such limit). For error messages and tests.
extern "C" int minipaged_paged_attention_v1_limits(int head_size, int block_size, int dtype,
                                                   int64_t* static_bytes,
                                                   int64_t* max_context_len) {
  return minipaged::dispatch(dtype, head_size, block_size, [&](auto type, auto head, auto block) {
    using T = typename decltype(type)::type;
    constexpr int BLOCK_SIZE = decltype(block)::value;
    const minipaged::KernelSmem& smem = minipaged::kernel_smem<
        minipaged::paged_attention_v1_kernel<T, decltype(head)::value, BLOCK_SIZE,
                                             minipaged::NUM_THREADS>>();
    if (smem.error) return smem.error;
    *static_bytes = (int64_t)smem.static_bytes;
    *max_context_len = (int64_t)(smem.max_dynamic / sizeof(float)) / BLOCK_SIZE * BLOCK_SIZE;
    return 0;
  });
}
#endif  // MP_PART_MAIN

#if MP_PART_8BIT
// The same kernels on an 8-bit cache (lesson 18): key_cache and value_cache hold int8
// (cache_dtype 3) or fp8 e4m3 (4) codes, key_scales and value_scales [num_blocks, num_kv_heads,
// block_size] float32 their scales (contiguous); dtype is the query's and out's. Strides are in
// cache elements (bytes). Same error codes; the workspace as minipaged_paged_attention_plan says.
extern "C" int minipaged_paged_attention_8bit(
    void* out, const void* query, const void* key_cache, const void* value_cache,
    const float* key_scales, const float* value_scales, const int* block_tables,
    const int* context_lens, int num_seqs, int num_heads, int num_kv_heads, int head_size,
    int block_size, int max_blocks_per_seq, int64_t q_seq_stride, int64_t q_head_stride,
    int64_t k_block_stride, int64_t k_head_stride, int64_t v_block_stride, int64_t v_head_stride,
    float scale, int max_context_len, int window, int dtype, int cache_dtype, int version,
    void* workspace, int64_t workspace_bytes, cudaStream_t stream) {
  if (window < 0) return minipaged::BAD_WINDOW;
  if (num_seqs == 0 || num_heads == 0) return 0;
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return minipaged::BAD_HEAD_COUNTS;
  if (num_seqs > minipaged::MAX_GRID_Y) return minipaged::TOO_MANY_SEQUENCES;
  if (version < 0 || version > 3) return minipaged::BAD_VERSION;
  if (!minipaged::aligned16(key_cache) || !minipaged::aligned16(value_cache) ||
      k_block_stride % 16 || k_head_stride % 16 || v_block_stride % 16 || v_head_stride % 16) {
    return minipaged::MISALIGNED;
  }
  minipaged::KernelArgs k{block_tables, context_lens, max_blocks_per_seq, num_kv_heads,
                          q_seq_stride, q_head_stride, k_block_stride, k_head_stride,
                          v_block_stride, v_head_stride, scale};
  k.k_scales = key_scales;
  k.v_scales = value_scales;
  k.window = window;
  // (no grouped kernel for 8-bit codes: version 0 runs V1 or V2, a forced 3 is refused)
  const minipaged::Plan plan = minipaged::make_plan(
      num_seqs, num_heads, num_kv_heads, head_size, max_context_len, version, true);
  if (plan.error) return plan.error;
  const minipaged::AttentionArgs a{
      out, query, key_cache, value_cache, num_seqs, num_heads, head_size, max_context_len, plan,
      static_cast<float*>(workspace), workspace_bytes / (int64_t)sizeof(float), stream, k};
  return minipaged::dispatch_8bit(
      dtype, cache_dtype, head_size, block_size, [&](auto type, auto code, auto head, auto block) {
        using T = typename decltype(type)::type;
        using C = typename decltype(code)::type;
        constexpr int H = decltype(head)::value, B = decltype(block)::value;
        return a.plan.version == 1 ? minipaged::launch_v1<T, H, B, C>(a)
                              : minipaged::launch_v2<T, H, B, C>(a);
      });
}
#endif  // MP_PART_8BIT
