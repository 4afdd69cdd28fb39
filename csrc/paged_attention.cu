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
// With grouped-query attention a third kernel (version 3, paged_attention_gqa.cuh) gives one CUDA block
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
// them (see "the fused reduce" in paged_attention_v2.cuh).
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

#include "paged_attention_common.cuh"  // trace switch, vectors, reductions

namespace minipaged {

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
// shape); the V2 kernels and the launch code are the files included below.

}  // namespace minipaged

// The other kernel families and the launch code, one file each (docs/ARCHITECTURE.md):
#include "paged_attention_v2.cuh"         // V2 and its reduce
#include "paged_attention_gqa.cuh"        // version 3, grouped-query attention
#include "paged_attention_plan.cuh"       // which kernel, which partition size
#include "paged_attention_launch.cuh"     // the launches and the instance switch
#include "paged_attention_instances.cuh"  // the extern "C" entry points, in three parts
