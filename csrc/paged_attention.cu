// Single-query paged attention: the decode kernel of lesson 05.
//
// Every running sequence has one new token whose query must attend to all the keys and values
// already in the KV cache. Those keys and values are not contiguous: they live in fixed-size
// blocks scattered over a pool, and the sequence's block table says where. This kernel reads them
// through the block table.
//
// Layouts (DESIGN §4; the same in minipaged/ops.py and minipaged/kernel_emulator.py):
//   query        [num_seqs, num_heads, head_size]              (any strides for the first two dims)
//   key_cache    [num_blocks, num_kv_heads, head_size / X, block_size, X]   X = 16 / sizeof(T)
//   value_cache  [num_blocks, num_kv_heads, head_size, block_size]
//   block_tables [num_seqs, max_blocks_per_seq] int32
//   context_lens [num_seqs] int32
//   out          [num_seqs, num_heads, head_size]              contiguous
//
// Work split: one CUDA block per (head, sequence), 128 threads = 4 warps of 32 lanes.
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
//            four warps add up through shared memory and the result is written out.
//
// Readability first: every reduction says which lanes exchange values. The emulator in
// minipaged/kernel_emulator.py follows this file step by step.

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cfloat>
#include <cstdint>

namespace minipaged {

constexpr int WARP_SIZE = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;

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

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

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
// The kernel
// ----------------------------------------------------------------------------------------------
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_kernel(
    T* __restrict__ out,                  // [num_seqs, num_heads, HEAD_SIZE]
    const T* __restrict__ query,          // [num_seqs, num_heads, HEAD_SIZE]
    const T* __restrict__ key_cache,      // [num_blocks, num_kv_heads, HEAD_SIZE/X, BLOCK_SIZE, X]
    const T* __restrict__ value_cache,    // [num_blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE]
    const int* __restrict__ block_tables, // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ context_lens, // [num_seqs]
    int max_blocks_per_seq, int num_kv_heads, int64_t q_seq_stride, int64_t q_head_stride,
    int64_t kv_block_stride, int64_t kv_head_stride, float scale, int logits_capacity) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  constexpr int X = Vec16<T>::N;                         // elements per 16-byte vector
  // phase 2 (q.k) constants
  constexpr int G = BLOCK_SIZE < WARP_SIZE ? WARP_SIZE / BLOCK_SIZE : 1;  // lanes per token
  constexpr int NUM_K_CHUNKS = HEAD_SIZE / X;            // 16-byte chunks in one key
  constexpr int K_CHUNKS_PER_LANE = (NUM_K_CHUNKS + G - 1) / G;
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

  const int head = blockIdx.x;
  const int num_heads = gridDim.x;
  const int seq = blockIdx.y;
  const int warp = threadIdx.x / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  const int kv_head = head / (num_heads / num_kv_heads);  // grouped-query attention
  const int context_len = context_lens[seq];
  const int num_blocks = (context_len + BLOCK_SIZE - 1) / BLOCK_SIZE;
  const int* block_table = block_tables + (int64_t)seq * max_blocks_per_seq;
  T* out_row = out + ((int64_t)seq * num_heads + head) * HEAD_SIZE;

  extern __shared__ float logits[];               // [logits_capacity]: one float per token
  __shared__ __align__(16) float q_smem[HEAD_SIZE];  // the query, fp32
  __shared__ float red_smem[2 * NUM_WARPS];       // max and sum scratch, one slot per warp
  __shared__ float out_smem[NUM_WARPS][HEAD_SIZE]; // each warp's partial output

  if (context_len > logits_capacity) {
    // The caller's max_context_len was too small: fail loudly (NaN) instead of overrunning
    // shared memory. Uniform over the CUDA block, so no barrier is left waiting.
    const float nan = __int_as_float(0x7fc00000);
    for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) out_row[d] = from_float<T>(nan);
    return;
  }

  // ---- phase 1: the query into shared memory --------------------------------------------------
  const T* q = query + seq * q_seq_stride + head * q_head_stride;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) q_smem[d] = to_float(q[d]);
  __syncthreads();

  // ---- phase 2: q.k for every token ------------------------------------------------------------
  const int token_in_block = lane / G;  // which token of the block this lane's group handles
  const int lane_in_group = lane % G;   // which of the key's chunks this lane handles
  float qk_max = -FLT_MAX;
  for (int b = warp; b < num_blocks; b += NUM_WARPS) {
    const int64_t physical_block = block_table[b];
    const T* k = key_cache + physical_block * kv_block_stride + kv_head * kv_head_stride +
                 token_in_block * X;  // chunk c of this token is at k + c * BLOCK_SIZE * X

    // Load first, then multiply: all of this lane's 16-byte loads are in flight together.
    uint4 k_raw[K_CHUNKS_PER_LANE];
#pragma unroll
    for (int i = 0; i < K_CHUNKS_PER_LANE; ++i) {
      const int c = lane_in_group + i * G;
      if (c < NUM_K_CHUNKS) k_raw[i] = load16(k + c * BLOCK_SIZE * X);
    }
    float partial = 0.f;
#pragma unroll
    for (int i = 0; i < K_CHUNKS_PER_LANE; ++i) {
      const int c = lane_in_group + i * G;
      if (c < NUM_K_CHUNKS) {
        float k_vals[X];
        unpack<T>(k_raw[i], k_vals);
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
    // The G lanes of a group are neighbours (lanes G*t .. G*t+G-1): a butterfly over masks
    // G/2 .. 1 adds their partial products, and every lane of the group gets the full q.k.
    // (With G == 1 there is nothing to add and the loop runs zero times.)
    const float qk = scale * butterfly<G / 2, 1>(partial, SumOp());

    const int token = b * BLOCK_SIZE + token_in_block;
    if (token < context_len) {
      if (lane_in_group == 0) logits[token] = qk;
      qk_max = fmaxf(qk_max, qk);
    }
  }

  // ---- phase 3: softmax ------------------------------------------------------------------------
  // Maximum: lanes of one group already agree, so the warp butterfly stops at mask G
  // (16, 8, ..., G); then the warps combine through red_smem[0 .. NUM_WARPS).
  // The barrier inside block_reduce also makes every logit visible to every thread.
  const float max_logit = block_reduce<NUM_WARPS, G>(qk_max, red_smem, -FLT_MAX, MaxOp());

  float exp_sum = 0.f;
  for (int i = threadIdx.x; i < context_len; i += NUM_THREADS) {
    const float e = expf(logits[i] - max_logit);
    logits[i] = e;
    exp_sum += e;
  }
  // Sum: each thread holds its own partial sum, so the warp butterfly runs all the way (16..1);
  // then the warps combine through red_smem[NUM_WARPS .. 2*NUM_WARPS).
  exp_sum = block_reduce<NUM_WARPS, 1>(exp_sum, red_smem + NUM_WARPS, 0.f, SumOp());
  const float inv_sum = 1.f / exp_sum;
  for (int i = threadIdx.x; i < context_len; i += NUM_THREADS) logits[i] *= inv_sum;
  __syncthreads();  // every probability is written before any warp reads them

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
    const int64_t physical_block = block_table[b];
    const T* v = value_cache + physical_block * kv_block_stride + kv_head * kv_head_stride +
                 slice * V_VEC;  // row r of this lane's slice is at v + r * BLOCK_SIZE
    const int first_token = b * BLOCK_SIZE + slice * V_VEC;
    // Tokens past the context (the tail of the last block) get probability 0 *and* value 0:
    // neither their logits slots nor their cache slots were ever written, and 0 * NaN = NaN.
    float probs[V_VEC];
#pragma unroll
    for (int j = 0; j < V_VEC; ++j) {
      probs[j] = first_token + j < context_len ? logits[first_token + j] : 0.f;
    }
    const bool last_block = b == num_blocks - 1;

#pragma unroll
    for (int i = 0; i < ROWS_PER_LANE; ++i) {
      const int row = row_in_pass + i * ROWS_PER_PASS;
      if (row < HEAD_SIZE) {
        float vals[V_VEC];
        unpack<T>(load16(v + row * BLOCK_SIZE), vals);
        if (last_block) {
#pragma unroll
          for (int j = 0; j < V_VEC; ++j) {
            if (first_token + j >= context_len) vals[j] = 0.f;
          }
        }
#pragma unroll
        for (int j = 0; j < V_VEC; ++j) acc[i] += probs[j] * vals[j];
      }
    }
  }

  // Lanes that share a row are neighbours (V_VECS_PER_ROW of them): a butterfly over masks
  // V_VECS_PER_ROW/2 .. 1 adds their slices, so each lane holds its rows' sums for this warp.
#pragma unroll
  for (int i = 0; i < ROWS_PER_LANE; ++i) {
    acc[i] = butterfly<V_VECS_PER_ROW / 2, 1>(acc[i], SumOp());
  }

  // Warps combine through shared memory: the first lane of each row team writes the warp's row
  // sums, then thread d adds up row d over the NUM_WARPS warps and writes the output.
  if (slice == 0) {
#pragma unroll
    for (int i = 0; i < ROWS_PER_LANE; ++i) {
      const int row = row_in_pass + i * ROWS_PER_PASS;
      if (row < HEAD_SIZE) out_smem[warp][row] = acc[i];
    }
  }
  __syncthreads();
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) sum += out_smem[w][d];
    out_row[d] = from_float<T>(sum);
  }
}

// ----------------------------------------------------------------------------------------------
// Launch: pick the template instance, size the shared memory, report errors as codes.
// ----------------------------------------------------------------------------------------------
constexpr int NUM_THREADS = 128;

struct AttentionArgs {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int* block_tables;
  const int* context_lens;
  int num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq;
  int64_t q_seq_stride, q_head_stride, kv_block_stride, kv_head_stride;
  float scale;
  int max_context_len;
  cudaStream_t stream;
};

template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
int launch(const AttentionArgs& a) {
  auto kernel = paged_attention_kernel<T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>;
  // One fp32 logit per token, rounded up to whole blocks (phase 4 reads block by block).
  const int capacity = (a.max_context_len + BLOCK_SIZE - 1) / BLOCK_SIZE * BLOCK_SIZE;
  const size_t dynamic_smem = (size_t)capacity * sizeof(float);

  int device = 0, optin_limit = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return (int)err;
  err = cudaDeviceGetAttribute(&optin_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return (int)err;
  cudaFuncAttributes attrs;
  err = cudaFuncGetAttributes(&attrs, kernel);
  if (err != cudaSuccess) return (int)err;
  if (dynamic_smem + attrs.sharedSizeBytes > (size_t)optin_limit) return -4;
  if (dynamic_smem > 48 * 1024) {  // above 48 KiB a kernel must opt in
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)dynamic_smem);
    if (err != cudaSuccess) return (int)err;
  }

  const dim3 grid(a.num_heads, a.num_seqs);
  kernel<<<grid, NUM_THREADS, dynamic_smem, a.stream>>>(
      static_cast<T*>(a.out), static_cast<const T*>(a.query),
      static_cast<const T*>(a.key_cache), static_cast<const T*>(a.value_cache),
      a.block_tables, a.context_lens, a.max_blocks_per_seq, a.num_kv_heads, a.q_seq_stride,
      a.q_head_stride, a.kv_block_stride, a.kv_head_stride, a.scale, capacity);
  return (int)cudaGetLastError();
}

template <typename T, int HEAD_SIZE>
int launch_for_head_size(const AttentionArgs& a) {
  switch (a.block_size) {
    case 8: return launch<T, HEAD_SIZE, 8>(a);
    case 16: return launch<T, HEAD_SIZE, 16>(a);
    case 32: return launch<T, HEAD_SIZE, 32>(a);
    default: return -3;
  }
}

template <typename T>
int launch_for_dtype(const AttentionArgs& a) {
  switch (a.head_size) {
    case 64: return launch_for_head_size<T, 64>(a);
    case 80: return launch_for_head_size<T, 80>(a);
    case 96: return launch_for_head_size<T, 96>(a);
    case 128: return launch_for_head_size<T, 128>(a);
    default: return -2;
  }
}

}  // namespace minipaged

// Error codes: 0 = success; > 0 = a cudaError_t; -1 = unsupported dtype; -2 = unsupported head
// size; -3 = unsupported block size; -4 = the logits of max_context_len tokens do not fit in this
// GPU's shared memory. dtype: 0 = float32, 1 = float16, 2 = bfloat16.
extern "C" int minipaged_paged_attention(
    void* out, const void* query, const void* key_cache, const void* value_cache,
    const int* block_tables, const int* context_lens, int num_seqs, int num_heads,
    int num_kv_heads, int head_size, int block_size, int max_blocks_per_seq,
    int64_t q_seq_stride, int64_t q_head_stride, int64_t kv_block_stride,
    int64_t kv_head_stride, float scale, int max_context_len, int dtype, cudaStream_t stream) {
  if (num_seqs == 0 || num_heads == 0) return 0;
  const minipaged::AttentionArgs a{out, query, key_cache, value_cache, block_tables,
                                   context_lens, num_seqs, num_heads, num_kv_heads, head_size,
                                   block_size, max_blocks_per_seq, q_seq_stride, q_head_stride,
                                   kv_block_stride, kv_head_stride, scale, max_context_len,
                                   stream};
  switch (dtype) {
    case 0: return minipaged::launch_for_dtype<float>(a);
    case 1: return minipaged::launch_for_dtype<__half>(a);
    case 2: return minipaged::launch_for_dtype<__nv_bfloat16>(a);
    default: return -1;
  }
}

// The most tokens whose logits fit in shared memory for this configuration on the current
// device (for error messages), or a negative error code.
extern "C" int minipaged_paged_attention_max_context_len(int head_size, int dtype) {
  int device = 0, optin_limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return -5;
  if (cudaDeviceGetAttribute(&optin_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
      cudaSuccess) {
    return -5;
  }
  if (dtype < 0 || dtype > 2) return -1;
  // The static shared memory: q_smem, red_smem and out_smem (see the kernel).
  const int static_bytes = (int)sizeof(float) * (head_size + 2 * (minipaged::NUM_THREADS / 32) +
                                                  (minipaged::NUM_THREADS / 32) * head_size);
  return (optin_limit - static_bytes) / (int)sizeof(float);
}
