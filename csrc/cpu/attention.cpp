// Paged attention on the CPU, reading keys and values through the block table in place.
//
// The CPU cousin of csrc/paged_attention.cu (lesson 05). Same cache layout:
//   key_cache    [num_blocks, num_kv_heads, head_size / X, block_size, X]   X = 16 / sizeof(T)
//   value_cache  [num_blocks, num_kv_heads, head_size, block_size]
// and the same four phases, with a CPU thread where the GPU has a CUDA block:
//
//   phase 1  queries -> fp32 scratch, scaled (one per query head of the kv head's group)
//   phase 2  q.k: walk the block table; for each KV block read its keys where they lie and
//            compute one fp32 logit per token (the CUDA kernel's thread groups become one
//            vectorised loop over the block's 16-byte chunks)
//   phase 3  softmax in fp32: maximum, exponentials and their sum
//   phase 4  probabilities . V: walk the blocks again, each value row (one head dimension, all
//            the block's tokens) is one contiguous run that a vector FMA consumes
//
// Work split: at::parallel_for over (sequence, kv head, tile of query rows). All query heads that
// share a kv head (grouped-query attention) are done by the same task, so each key and value is
// read from memory once per kv head, not once per query head.
//
// One routine serves decode and prefill: sequence s owns query rows [query_start_loc[s],
// query_start_loc[s+1]); they are the last q_len positions of its context_lens[s] cached tokens,
// and the row at position p attends to positions 0..p (causal). Decode is q_len == 1. With a
// sliding window W (Mistral, Gemma 3's sliding layers; 0: none) the row at p attends to
// p - W + 1 .. p only, and the blocks before the task's first row's window are never read: the
// block manager may have given them to another sequence (their table entries are then 0).
//
// NaN safety: slots past the context may hold anything (NaN included), and so may the padding
// entries of a block table. Blocks past the last one are never touched; in the sequence's last,
// partly filled block only the valid tokens are read (probability 0 times NaN would be NaN).
//
// An 8-bit cache (lesson 18): key_cache and value_cache hold fp8 e4m3 or int8 codes, and
// key_scales / value_scales [num_blocks, num_kv_heads, block_size] one float per token and kv
// head. The loops read the codes as they are and apply the scales per token, where it is cheap:
// a logit is (q . codes) * key_scale, a probability is multiplied by value_scale before it meets
// the value codes. The `_8bit` entry points at the end of the file take the scales.
//
// Argument checks: the loops trust what they read (a block number is an address), so every
// argument is checked before they run (`check_caches`, `check_batch`, `check_slots`) and a bad
// one raises a RuntimeError naming the argument, its value and the limit. The checks cost one
// pass over the sequences and the block-table entries their contexts use (or over the slots):
// nothing per cached element.

// NOTE: the ATen headers this file uses and pybind11 with its at::Tensor caster, not
// <torch/extension.h> (all of torch's C++ API): a first build takes about a quarter less time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#ifndef MINIPAGED_KERNELS_ONLY
#include <torch/csrc/utils/pybind.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace minipaged_cpu {

// ----------------------------------------------------------------------------------------------
// Element conversions. bfloat16 -> float is the 16 bits moved to the top of a float: written out
// so the compiler turns the loops below into vector shifts.
// ----------------------------------------------------------------------------------------------
inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float to_float(int8_t v) { return static_cast<float>(v); }
// fp8 e4m3 -> float through a 256-entry table: c10's conversion works bit by bit, and on every
// element of a decode step it costs more than the arithmetic (8x the int8 step, measured).
inline std::array<float, 256> fp8_table() {
  std::array<float, 256> table{};
  for (int i = 0; i < 256; ++i)
    table[i] = static_cast<float>(c10::Float8_e4m3fn((uint8_t)i, c10::Float8_e4m3fn::from_bits()));
  return table;
}
const std::array<float, 256> kFp8ToFloat = fp8_table();
inline float to_float(c10::Float8_e4m3fn v) { return kFp8ToFloat[v.x]; }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }  // round to nearest even

// Ask for the cache lines of [p, p + bytes) ahead of their use.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

// Lanes of the fp32 accumulators: one 256-bit register. Loops of this many independent fp32
// FMAs are what the compiler vectorises (AVX2: one instruction; AVX-512 and NEON: fine too).
constexpr int LANES = 8;

// ----------------------------------------------------------------------------------------------
// Everything one task needs to know, in elements (not bytes).
// ----------------------------------------------------------------------------------------------
struct Shapes {
  int num_heads, num_kv_heads, head_size, max_blocks_per_seq;
  int64_t q_token_stride, q_head_stride;   // query  [T, num_heads, head_size]
  int64_t kv_block_stride, kv_head_stride; // both caches: same strides over blocks and heads
  float scale;
  int window = 0;                          // a sliding window's tokens; 0: the whole context
};

// An 8-bit cache's scales, [num_blocks, num_kv_heads, block_size] each; null for a 16/32-bit one.
struct Scales {
  const float* key = nullptr;
  const float* value = nullptr;
};

// Query rows of one task: rows [row_begin, row_end) of one sequence, all heads of one group.
// T is the query's type, C the cache's (T itself, or an 8-bit code with `scales`).
template <typename T, typename C, int BLOCK_SIZE>
void attend_rows(T* out, const T* query, const C* key_cache, const C* value_cache,
                 const int* block_table, int context_len, int q_len, int row_begin, int row_end,
                 int64_t first_token, int kv_head, const Shapes& sh, std::vector<float>& scratch,
                 const Scales& scales = Scales{}) {
  constexpr int X = 16 / sizeof(C);               // elements per 16-byte key chunk
  constexpr int K_RUN = BLOCK_SIZE * X;           // one chunk index of a block: BLOCK_SIZE * X
  // lanes of the q.k accumulators: a whole number of chunks (16 for 8-bit codes)
  constexpr int KW = K_RUN < LANES ? K_RUN : (X > LANES ? X : LANES);
  constexpr int VW = BLOCK_SIZE < LANES ? BLOCK_SIZE : LANES;  // lanes of the p.V accumulators
  static_assert(KW % X == 0 && K_RUN % KW == 0 && BLOCK_SIZE % VW == 0, "powers of two");

  const int head_size = sh.head_size;
  const int num_chunks = head_size / X;
  const int group = sh.num_heads / sh.num_kv_heads;  // query heads per kv head
  const int num_rows = row_end - row_begin;
  const int num_vecs = num_rows * group;             // query vectors of this task
  // Row r sits at position context_len - q_len + r and sees that many tokens plus itself.
  const int last_len = context_len - q_len + row_end;  // tokens the last row sees
  const int num_blocks = (last_len + BLOCK_SIZE - 1) / BLOCK_SIZE;
  auto row_len = [&](int v) { return context_len - q_len + row_begin + v / group + 1; };
  // The first position a row sees: 0, or with a window the oldest of its W newest.
  auto row_lo = [&](int v) { return sh.window > 0 ? std::max(0, row_len(v) - sh.window) : 0; };
  const int first_block = row_lo(0) / BLOCK_SIZE;  // row 0 is the task's earliest

  // Scratch: queries as repeating lane patterns, logits, p.V accumulators.
  const size_t q_size = (size_t)num_vecs * num_chunks * KW;
  const size_t logit_size = (size_t)num_vecs * last_len;
  const size_t acc_size = (size_t)num_vecs * head_size * VW;
  scratch.resize(q_size + logit_size + acc_size + num_vecs);
  float* q_pattern = scratch.data();       // [num_vecs][num_chunks][KW]
  float* logits = q_pattern + q_size;      // [num_vecs][last_len]
  float* acc = logits + logit_size;        // [num_vecs][head_size][VW]
  float* inv_sum = acc + acc_size;         // [num_vecs]: 1 / sum of exponentials

  // ---- phase 1: queries, scaled, in fp32 ------------------------------------------------------
  // Chunk c of the query is repeated KW / X times, so that one lane pattern lines up with KW
  // consecutive elements of a key chunk run (tokens t, t+1, ... each X elements wide).
  for (int v = 0; v < num_vecs; ++v) {
    const int head = kv_head * group + v % group;
    const T* q = query + (first_token + row_begin + v / group) * sh.q_token_stride +
                 head * sh.q_head_stride;
    float* qp = q_pattern + (size_t)v * num_chunks * KW;
    for (int c = 0; c < num_chunks; ++c)
      for (int w = 0; w < KW; ++w) qp[c * KW + w] = to_float(q[c * X + w % X]) * sh.scale;
  }

  // ---- phase 2: q.k, block by block, keys read in place ---------------------------------------
  const int64_t kv_offset = kv_head * sh.kv_head_stride;  // this kv head's part of a block
  const int64_t block_bytes = (int64_t)head_size * BLOCK_SIZE * sizeof(C);
  // scales of kv head `kv_head` in block `block`: BLOCK_SIZE floats
  auto scale_row = [&](const float* s, int block) {
    return s + ((int64_t)block * sh.num_kv_heads + kv_head) * BLOCK_SIZE;
  };
  for (int b = first_block; b < num_blocks; ++b) {
    const C* k_block = key_cache + block_table[b] * sh.kv_block_stride + kv_offset;
    const float* k_scale = scales.key ? scale_row(scales.key, block_table[b]) : nullptr;
    if (b + 1 < num_blocks)  // the blocks are scattered: no hardware prefetcher guesses the next
      prefetch(key_cache + block_table[b + 1] * sh.kv_block_stride + kv_offset, block_bytes);
    const int block_start = b * BLOCK_SIZE;
    // A block is "whole" when all its slots hold tokens of this sequence: then the vector loops
    // may read all of it even for a row that sees only part of it (a causal cut in prefill).
    const bool whole = context_len - block_start >= BLOCK_SIZE;
    for (int v = 0; v < num_vecs; ++v) {
      const int valid = std::min(BLOCK_SIZE, row_len(v) - block_start);  // tokens this row sees
      const int lo = std::max(0, row_lo(v) - block_start);  // its first in the window
      if (valid <= lo) continue;  // causal: a later block; or one before the row's window
      const float* qp = q_pattern + (size_t)v * num_chunks * KW;
      float* row_logits = logits + (size_t)v * last_len + block_start;
      if (whole) {
        // partial[t * X + i] sums q[c * X + i] * k[c][t][i] over the chunks c.
        float partial[K_RUN] = {};
        for (int c = 0; c < num_chunks; ++c) {
          const C* k_chunk = k_block + (int64_t)c * K_RUN;  // [BLOCK_SIZE][X]
          const float* qc = qp + c * KW;
          for (int j = 0; j < K_RUN; j += KW)
            for (int w = 0; w < KW; ++w) partial[j + w] += qc[w] * to_float(k_chunk[j + w]);
        }
        for (int t = lo; t < valid; ++t) {
          float dot = 0.f;
          for (int i = 0; i < X; ++i) dot += partial[t * X + i];
          row_logits[t] = k_scale ? dot * k_scale[t] : dot;
        }
      } else {
        // The sequence's last, partly filled block: only the valid tokens are read.
        for (int t = lo; t < valid; ++t) {
          float dot = 0.f;
          for (int c = 0; c < num_chunks; ++c)
            for (int i = 0; i < X; ++i)
              dot += qp[c * KW + i] * to_float(k_block[((int64_t)c * BLOCK_SIZE + t) * X + i]);
          row_logits[t] = k_scale ? dot * k_scale[t] : dot;
        }
      }
    }
  }

  // ---- phase 3: softmax in fp32 (the 1 / sum is applied at the end, to the output) ------------
  for (int v = 0; v < num_vecs; ++v) {
    float* row_logits = logits + (size_t)v * last_len;
    const int n = row_len(v), lo = row_lo(v);
    float max_logit = -std::numeric_limits<float>::infinity();
    for (int t = lo; t < n; ++t) max_logit = std::max(max_logit, row_logits[t]);
    float sum = 0.f;
    for (int t = lo; t < n; ++t) {
      row_logits[t] = std::exp(row_logits[t] - max_logit);
      sum += row_logits[t];
    }
    inv_sum[v] = 1.f / sum;
  }

  // ---- phase 4: probabilities . V, values read in place ---------------------------------------
  std::fill(acc, acc + acc_size, 0.f);
  for (int b = first_block; b < num_blocks; ++b) {
    const C* v_block = value_cache + block_table[b] * sh.kv_block_stride + kv_offset;
    const float* v_scale = scales.value ? scale_row(scales.value, block_table[b]) : nullptr;
    if (b + 1 < num_blocks)
      prefetch(value_cache + block_table[b + 1] * sh.kv_block_stride + kv_offset, block_bytes);
    const int block_start = b * BLOCK_SIZE;
    const bool whole = context_len - block_start >= BLOCK_SIZE;
    for (int v = 0; v < num_vecs; ++v) {
      const int valid = std::min(BLOCK_SIZE, row_len(v) - block_start);
      const int lo = std::max(0, row_lo(v) - block_start);
      if (valid <= lo) continue;
      const float* p = logits + (size_t)v * last_len + block_start;  // this block's probabilities
      float* __restrict__ acc_v = acc + (size_t)v * head_size * VW;
      // an 8-bit cache: each probability carries its token's value scale
      auto p_of = [&](int t) { return v_scale ? p[t] * v_scale[t] : p[t]; };
      if (whole) {
        // NOTE: the probabilities are copied into a local array first: the compiler then knows
        // the accumulators cannot overwrite them, and keeps them in vector registers. Tokens
        // past a causal cut get probability 0 (their values are real, finite tokens).
        float p_block[BLOCK_SIZE];
        for (int t = 0; t < BLOCK_SIZE; ++t) p_block[t] = t >= lo && t < valid ? p_of(t) : 0.f;
        for (int d = 0; d < head_size; ++d) {
          const C* v_row = v_block + (int64_t)d * BLOCK_SIZE;  // head dimension d, all tokens
          float lanes[VW];
          for (int w = 0; w < VW; ++w) lanes[w] = acc_v[d * VW + w];
          for (int j = 0; j < BLOCK_SIZE; j += VW)
            for (int w = 0; w < VW; ++w) lanes[w] += p_block[j + w] * to_float(v_row[j + w]);
          for (int w = 0; w < VW; ++w) acc_v[d * VW + w] = lanes[w];
        }
      } else {
        for (int d = 0; d < head_size; ++d) {
          const C* v_row = v_block + (int64_t)d * BLOCK_SIZE;
          for (int t = lo; t < valid; ++t) acc_v[d * VW + t % VW] += p_of(t) * to_float(v_row[t]);
        }
      }
    }
  }
  for (int v = 0; v < num_vecs; ++v) {
    const int head = kv_head * group + v % group;
    T* o = out + ((first_token + row_begin + v / group) * sh.num_heads + head) * head_size;
    const float* acc_v = acc + (size_t)v * head_size * VW;
    for (int d = 0; d < head_size; ++d) {
      float sum = 0.f;
      for (int w = 0; w < VW; ++w) sum += acc_v[d * VW + w];
      o[d] = from_float<T>(sum * inv_sum[v]);
    }
  }
}

// Query rows per task in prefill: enough to reuse each KV block from cache for several rows,
// few enough that a task's accumulators stay small, and many tasks for the threads.
constexpr int ROWS_PER_TASK = 8;

template <typename T, int BLOCK_SIZE, typename C = T>
void paged_prefill_attention_impl(at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache,
                                  const at::Tensor& value_cache,
                                  const at::Tensor& block_tables,
                                  const at::Tensor& query_start_loc,
                                  const at::Tensor& context_lens, const Shapes& sh,
                                  const Scales& scales = Scales{}) {
  const int num_seqs = context_lens.size(0);
  const int* loc = query_start_loc.data_ptr<int>();
  const int* ctx = context_lens.data_ptr<int>();
  // The task list: (sequence, kv head, first row). Built once, then shared out among threads.
  struct Task { int seq, kv_head, row_begin, row_end; };
  std::vector<Task> tasks;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = loc[s + 1] - loc[s];  // (check_batch: 0 <= q_len <= ctx[s])
    for (int r = 0; r < q_len; r += ROWS_PER_TASK)
      for (int h = 0; h < sh.num_kv_heads; ++h)
        tasks.push_back({s, h, r, std::min(q_len, r + ROWS_PER_TASK)});
  }
  T* out_ptr = out.data_ptr<T>();
  const T* q_ptr = query.data_ptr<T>();
  const C* k_ptr = key_cache.data_ptr<C>();
  const C* v_ptr = value_cache.data_ptr<C>();
  const int* tables = block_tables.data_ptr<int>();
  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;  // reused by all of this thread's tasks
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const int s = task.seq;
      attend_rows<T, C, BLOCK_SIZE>(out_ptr, q_ptr, k_ptr, v_ptr,
                                    tables + (int64_t)s * sh.max_blocks_per_seq, ctx[s],
                                    loc[s + 1] - loc[s], task.row_begin, task.row_end, loc[s],
                                    task.kv_head, sh, scratch, scales);
    }
  });
}

// The block size is a compile-time constant of the inner loops, as in the CUDA kernel.
#define MINIPAGED_DISPATCH_BLOCK_SIZE(block_size, ...)                                     \
  [&] {                                                                                   \
    switch (block_size) {                                                                 \
      case 1: { constexpr int BLOCK_SIZE = 1; return __VA_ARGS__(); }                      \
      case 2: { constexpr int BLOCK_SIZE = 2; return __VA_ARGS__(); }                      \
      case 4: { constexpr int BLOCK_SIZE = 4; return __VA_ARGS__(); }                      \
      case 8: { constexpr int BLOCK_SIZE = 8; return __VA_ARGS__(); }                      \
      case 16: { constexpr int BLOCK_SIZE = 16; return __VA_ARGS__(); }                    \
      case 32: { constexpr int BLOCK_SIZE = 32; return __VA_ARGS__(); }                    \
      case 64: { constexpr int BLOCK_SIZE = 64; return __VA_ARGS__(); }                    \
      case 128: { constexpr int BLOCK_SIZE = 128; return __VA_ARGS__(); }                  \
      default: TORCH_CHECK(false, "block size must be a power of two up to 128, got ", block_size); \
    }                                                                                     \
  }()

// The 8-bit caches' instances of the kernel (lesson 18: int8 and fp8 codes, for each query type
// and block size) are compiled in attention_int8.cpp and attention_fp8.cpp beside this file, at
// the same time as this one: a first build on two cores then takes about two thirds of the time.
// Here they are only declared (`extern template`), so this file does not compile them again.
#define MINIPAGED_KERNEL_INSTANCE(PREFIX, T, C, B)                                          \
  PREFIX template void paged_prefill_attention_impl<T, B, C>(                               \
      at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,                 \
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const Shapes&, const Scales&);
#define MINIPAGED_KERNEL_BLOCK_SIZES(PREFIX, T, C)                                          \
  MINIPAGED_KERNEL_INSTANCE(PREFIX, T, C, 1) MINIPAGED_KERNEL_INSTANCE(PREFIX, T, C, 2)     \
  MINIPAGED_KERNEL_INSTANCE(PREFIX, T, C, 4) MINIPAGED_KERNEL_INSTANCE(PREFIX, T, C, 8)     \
  MINIPAGED_KERNEL_INSTANCE(PREFIX, T, C, 16) MINIPAGED_KERNEL_INSTANCE(PREFIX, T, C, 32)   \
  MINIPAGED_KERNEL_INSTANCE(PREFIX, T, C, 64) MINIPAGED_KERNEL_INSTANCE(PREFIX, T, C, 128)
#define MINIPAGED_INT8_KERNEL_INSTANCES(PREFIX)                                             \
  MINIPAGED_KERNEL_BLOCK_SIZES(PREFIX, float, int8_t)                                       \
  MINIPAGED_KERNEL_BLOCK_SIZES(PREFIX, c10::BFloat16, int8_t)                               \
  MINIPAGED_KERNEL_BLOCK_SIZES(PREFIX, c10::Half, int8_t)
#define MINIPAGED_FP8_KERNEL_INSTANCES(PREFIX)                                              \
  MINIPAGED_KERNEL_BLOCK_SIZES(PREFIX, float, c10::Float8_e4m3fn)                           \
  MINIPAGED_KERNEL_BLOCK_SIZES(PREFIX, c10::BFloat16, c10::Float8_e4m3fn)                   \
  MINIPAGED_KERNEL_BLOCK_SIZES(PREFIX, c10::Half, c10::Float8_e4m3fn)

#ifdef MINIPAGED_KERNELS_ONLY
}  // namespace minipaged_cpu
#else
MINIPAGED_INT8_KERNEL_INSTANCES(extern)
MINIPAGED_FP8_KERNEL_INSTANCES(extern)

// float32, bfloat16 and float16: the cache dtypes the engine uses.
#define MINIPAGED_DISPATCH_DTYPE(dtype, name, ...)                          \
  AT_DISPATCH_SWITCH(dtype, name,                                           \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)              \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)           \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// ----------------------------------------------------------------------------------------------
// Argument checks
// ----------------------------------------------------------------------------------------------
struct CacheShape {
  int64_t num_blocks, num_kv_heads, head_size, block_size;
};

inline bool is_8bit(at::ScalarType dtype) {
  return dtype == at::kChar || dtype == at::kFloat8_e4m3fn;
}

// key_cache [num_blocks, num_kv_heads, head_size / x, block_size, x] and
// value_cache [num_blocks, num_kv_heads, head_size, block_size]: one dtype, contiguous, agreeing.
CacheShape check_caches(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(key_cache.device().is_cpu() && value_cache.device().is_cpu(),
              "key_cache and value_cache must be CPU tensors, got ", key_cache.device(), " and ",
              value_cache.device());
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf ||
              is_8bit(dtype), "key_cache: dtype must be float32, bfloat16, float16, or int8 / "
              "float8_e4m3fn with scales, got ", dtype);
  TORCH_CHECK(value_cache.scalar_type() == dtype, "value_cache is ", value_cache.scalar_type(),
              " but key_cache is ", dtype);
  TORCH_CHECK(key_cache.dim() == 5, "key_cache must be [num_blocks, num_kv_heads, head_size / x, "
              "block_size, x], got shape ", key_cache.sizes());
  TORCH_CHECK(value_cache.dim() == 4, "value_cache must be [num_blocks, num_kv_heads, head_size, "
              "block_size], got shape ", value_cache.sizes());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "key_cache and value_cache must be contiguous");
  const int64_t x = 16 / key_cache.element_size();
  TORCH_CHECK(key_cache.size(4) == x, "key_cache's last dimension must be x = 16 / element size = ",
              x, " for ", dtype, ", got ", key_cache.size(4));
  const CacheShape c{key_cache.size(0), key_cache.size(1), key_cache.size(2) * x,
                     key_cache.size(3)};
  TORCH_CHECK(c.num_kv_heads >= 1 && c.head_size >= 1 && c.block_size >= 1,
              "key_cache has an empty dimension: shape ", key_cache.sizes());
  TORCH_CHECK(value_cache.size(0) == c.num_blocks && value_cache.size(1) == c.num_kv_heads &&
              value_cache.size(2) == c.head_size && value_cache.size(3) == c.block_size,
              "value_cache ", value_cache.sizes(), " does not match key_cache ", key_cache.sizes(),
              ": expected [", c.num_blocks, ", ", c.num_kv_heads, ", ", c.head_size, ", ",
              c.block_size, "]");
  return c;
}

// query [num_tokens, num_heads, head_size], any strides but the last.
void check_query(const at::Tensor& query, const at::Tensor& key_cache, const CacheShape& c) {
  TORCH_CHECK(query.device().is_cpu(), "query must be a CPU tensor, got ", query.device());
  TORCH_CHECK(query.dim() == 3, "query must be [num_tokens, num_heads, head_size], got shape ",
              query.sizes());
  TORCH_CHECK(query.stride(2) == 1, "query must be contiguous in its last dimension (head_size), "
              "got strides ", query.strides());
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() || is_8bit(key_cache.scalar_type()),
              "query is ", query.scalar_type(), " but the caches are ", key_cache.scalar_type());
  TORCH_CHECK(query.size(2) == c.head_size, "query has head size ", query.size(2),
              " but the caches hold head size ", c.head_size);
  TORCH_CHECK(query.size(1) >= 1 && query.size(1) % c.num_kv_heads == 0, "num_heads = ",
              query.size(1), " (query) must be a positive multiple of num_kv_heads = ",
              c.num_kv_heads, " (caches)");
}

void check_int32(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == dim &&
              t.is_contiguous(), name, " must be a contiguous ", dim, "-D int32 CPU tensor, got ",
              t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
}

// Sequence s owns query rows [loc[s], loc[s + 1]), attends to context_lens[s] cached tokens and
// reads them through block_tables[s, 0 .. ceil(context_lens[s] / block_size)): every block
// number the kernel will use is checked, the padding past a sequence's blocks is not read.
void check_batch(const at::Tensor& query, const at::Tensor& block_tables,
                 const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                 const CacheShape& c) {
  check_int32(context_lens, "context_lens", 1);
  check_int32(query_start_loc, "query_start_loc", 1);
  check_int32(block_tables, "block_tables", 2);
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1, "query_start_loc has ",
              query_start_loc.size(0), " entries for ", num_seqs,
              " sequences (needs num_seqs + 1)");
  TORCH_CHECK(block_tables.size(0) >= num_seqs, "block_tables has ", block_tables.size(0),
              " rows for ", num_seqs, " sequences");
  const int* loc = query_start_loc.data_ptr<int>();
  const int* ctx = context_lens.data_ptr<int>();
  const int* tables = block_tables.data_ptr<int>();
  const int64_t width = block_tables.size(1);
  TORCH_CHECK(loc[0] == 0, "query_start_loc[0] must be 0, got ", loc[0]);
  TORCH_CHECK(loc[num_seqs] == query.size(0), "query_start_loc[", num_seqs, "] = ",
              loc[num_seqs], " but query has ", query.size(0), " rows");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = (int64_t)loc[s + 1] - loc[s];
    TORCH_CHECK(q_len >= 0, "query_start_loc must not decrease: query_start_loc[", s, "] = ",
                loc[s], " > query_start_loc[", s + 1, "] = ", loc[s + 1]);
    TORCH_CHECK(ctx[s] >= 0, "context_lens[", s, "] = ", ctx[s], " is negative");
    if (q_len == 0) continue;  // no query row: nothing of this sequence is read
    TORCH_CHECK(ctx[s] >= q_len, "context_lens[", s, "] = ", ctx[s], " but sequence ", s, " has ",
                q_len, " query row(s): ", ctx[s] == 0 ? "an empty context; " : "",
                "each row attends to the cached tokens up to and including its own, so the "
                "context must hold at least the query rows (>= 1)");
    const int64_t needed = (ctx[s] + c.block_size - 1) / c.block_size;
    TORCH_CHECK(needed <= width, "context_lens[", s, "] = ", ctx[s], " needs ", needed,
                " blocks of ", c.block_size, " tokens but block_tables has only ", width,
                " columns");
    // One branch-free pass (a vector loop) over the blocks in use; find the culprit only on
    // failure. Unsigned compare: a negative block number is a huge one.
    const int* row = tables + s * width;
    bool bad = false;
    for (int64_t b = 0; b < needed; ++b) {
      bad |= (uint64_t)(uint32_t)row[b] >= (uint64_t)c.num_blocks;
    }
    if (bad) {
      for (int64_t b = 0; b < needed; ++b) {
        TORCH_CHECK(row[b] >= 0 && row[b] < c.num_blocks, "block_tables[", s, ", ", b, "] = ",
                    row[b], " is not a block of the cache: block numbers are in [0, ",
                    c.num_blocks, ") (sequence ", s, " has context ", ctx[s], ")");
      }
    }
  }
}

// Calls body(C{}) with C the 8-bit code type of `dtype` (int8 or float8 e4m3).
template <typename Body>
void dispatch_code(at::ScalarType dtype, Body&& body) {
  if (dtype == at::kChar) {
    body(int8_t{});
  } else {
    body(c10::Float8_e4m3fn{});
  }
}

// Both prefill entry points, once the caches are checked: `scales` null for a 16/32-bit cache.
at::Tensor attend_all(const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                         double scale, const CacheShape& c, const Scales* scales,
                         int64_t window) {
  check_query(query, key_cache, c);
  check_batch(query, block_tables, query_start_loc, context_lens, c);
  TORCH_CHECK(window >= 0 && window <= std::numeric_limits<int>::max(), "window must be a "
              "number of tokens >= 0 (0: none), got ", window);
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  if (context_lens.numel() == 0 || query.size(0) == 0) return out;
  const Shapes sh{(int)query.size(1), (int)c.num_kv_heads, (int)c.head_size,
                  (int)block_tables.size(1), query.stride(0), query.stride(1),
                  key_cache.stride(0), key_cache.stride(1), (float)scale, (int)window};
  auto run = [&](auto code) {  // code: the cache's element type (the query's, or 8-bit)
    MINIPAGED_DISPATCH_DTYPE(query.scalar_type(), "paged_prefill_attention", [&] {
      using C = std::conditional_t<std::is_same<decltype(code), bool>::value, scalar_t,
                                   decltype(code)>;
      MINIPAGED_DISPATCH_BLOCK_SIZE(c.block_size, [&] {
        paged_prefill_attention_impl<scalar_t, BLOCK_SIZE, C>(
            out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens, sh,
            scales ? *scales : Scales{});
      });
    });
  };
  if (scales) {
    dispatch_code(key_cache.scalar_type(), run);
  } else {
    run(false);  // (bool: "the query's own type")
  }
  return out;
}

// out[T, heads, head_size] = causal attention of each sequence's newest rows over its cache.
at::Tensor paged_prefill_attention(at::Tensor query, at::Tensor key_cache,
                                      at::Tensor value_cache, at::Tensor block_tables,
                                      at::Tensor query_start_loc, at::Tensor context_lens,
                                      double scale, int64_t window) {
  const CacheShape c = check_caches(key_cache, value_cache);
  return attend_all(query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                    scale, c, nullptr, window);
}

// Decode has one query row per sequence: query_start_loc = 0, 1, 2, ...
at::Tensor decode_query_start_loc(const at::Tensor& query,
                                     const at::Tensor& context_lens) {
  check_int32(context_lens, "context_lens", 1);
  TORCH_CHECK(query.dim() == 3 && query.size(0) == context_lens.size(0), "decode has one query "
              "row per sequence: query ", query.sizes(), " but context_lens has ",
              context_lens.size(0), " entries");
  return at::arange(query.size(0) + 1, context_lens.options());
}

at::Tensor paged_attention(at::Tensor query, at::Tensor key_cache,
                              at::Tensor value_cache, at::Tensor block_tables,
                              at::Tensor context_lens, double scale, int64_t window) {
  return paged_prefill_attention(query, key_cache, value_cache, block_tables,
                                 decode_query_start_loc(query, context_lens), context_lens, scale,
                                 window);
}

// ----------------------------------------------------------------------------------------------
// reshape_and_cache: each new token's key and value into its slot (slot -1: not cached)
// ----------------------------------------------------------------------------------------------
// write(token, kv_head, block, offset) for every cached token (slot -1: skipped) and kv head.
template <typename Write>
void for_each_slot(const at::Tensor& slot_mapping, int64_t num_kv_heads, int64_t block_size,
                   Write&& write) {
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::parallel_for(0, slot_mapping.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const int64_t slot = slots[token];
      if (slot < 0) continue;  // -1: a padding token (check_slots refused anything else)
      for (int64_t h = 0; h < num_kv_heads; ++h)
        write(token, h, slot / block_size, slot % block_size);
    }
  });
}

template <typename T>
void reshape_and_cache_impl(const at::Tensor& key, const at::Tensor& value,
                            at::Tensor& key_cache, at::Tensor& value_cache,
                            const at::Tensor& slot_mapping) {
  constexpr int X = 16 / sizeof(T);
  const int64_t head_size = key.size(2), block_size = key_cache.size(3);
  const int64_t block_stride = key_cache.stride(0), head_stride = key_cache.stride(1);
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  T* kc = key_cache.data_ptr<T>();
  T* vc = value_cache.data_ptr<T>();
  for_each_slot(slot_mapping, key.size(1), block_size,
                [&](int64_t token, int64_t h, int64_t block, int64_t offset) {
    const T* k_src = k + token * key.stride(0) + h * key.stride(1);
    const T* v_src = v + token * value.stride(0) + h * value.stride(1);
    T* k_dst = kc + block * block_stride + h * head_stride;  // [head_size / X][block][X]
    T* v_dst = vc + block * block_stride + h * head_stride;  // [head_size][block]
    for (int64_t d = 0; d < head_size; ++d) {
      k_dst[((d / X) * block_size + offset) * X + d % X] = k_src[d];
      v_dst[d * block_size + offset] = v_src[d];
    }
  });
}

// slot_mapping[t] in [0, num_blocks * block_size), or -1: token t is not cached (vLLM's
// padding slot; the engine itself never passes it). Any other value is refused: -2 or a slot past
// the pool is a bug upstream, and writing it would corrupt memory.
void check_slots(const at::Tensor& slot_mapping, int64_t num_tokens, const CacheShape& c) {
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong &&
              slot_mapping.dim() == 1 && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous 1-D int64 CPU tensor, got ",
              slot_mapping.scalar_type(), " of shape ", slot_mapping.sizes());
  TORCH_CHECK(slot_mapping.size(0) == num_tokens, "slot_mapping has ", slot_mapping.size(0),
              " slots for ", num_tokens, " tokens");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = c.num_blocks * c.block_size;
  bool bad = false;  // slot + 1 in [0, num_slots]: one unsigned compare, a vector loop
  for (int64_t t = 0; t < num_tokens; ++t) bad |= (uint64_t)(slots[t] + 1) > (uint64_t)num_slots;
  if (!bad) return;
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                " is outside the cache's slots [0, ", num_slots, ") (", c.num_blocks,
                " blocks of ", c.block_size, " tokens); -1 marks a token that is not cached");
  }
}

// key, value [num_tokens, num_kv_heads, head_size] of the caches' shape, and their slots.
void check_new_tokens(const at::Tensor& key, const at::Tensor& value,
                      const at::Tensor& slot_mapping, const CacheShape& c) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu(), "key and value must be CPU "
              "tensors, got ", key.device(), " and ", value.device());
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key ", key.sizes(), " and value ",
              value.sizes(), " must both be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value must be contiguous in "
              "their last dimension (head_size), got strides ", key.strides(), " and ",
              value.strides());
  TORCH_CHECK(key.size(1) == c.num_kv_heads, "key and value have ", key.size(1),
              " kv heads but the caches hold ", c.num_kv_heads);
  TORCH_CHECK(key.size(2) == c.head_size, "key and value have head size ", key.size(2),
              " but the caches hold head size ", c.head_size);
  check_slots(slot_mapping, key.size(0), c);
}

void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                       at::Tensor value_cache, at::Tensor slot_mapping) {
  const CacheShape c = check_caches(key_cache, value_cache);
  check_new_tokens(key, value, slot_mapping, c);
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
              value.scalar_type() == key_cache.scalar_type(), "key is ", key.scalar_type(),
              " and value is ", value.scalar_type(), " but the caches are ",
              key_cache.scalar_type());
  MINIPAGED_DISPATCH_DTYPE(key.scalar_type(), "reshape_and_cache", [&] {
    reshape_and_cache_impl<scalar_t>(key, value, key_cache, value_cache, slot_mapping);
  });
}

// ----------------------------------------------------------------------------------------------
// The 8-bit cache (lesson 18): the same routines, codes in the caches, scales beside them
// ----------------------------------------------------------------------------------------------
constexpr float FP8_MAX = 448.f;  // the largest float8 e4m3 (fn) value
constexpr float INT8_MAX_CODE = 127.f;

// key_scales and value_scales: float32 [num_blocks, num_kv_heads, block_size], contiguous, next
// to 8-bit caches; and 16/32-bit caches take no scales.
Scales check_scales(const at::Tensor& key_cache, const at::Tensor& key_scales,
                    const at::Tensor& value_scales, const CacheShape& c) {
  TORCH_CHECK(is_8bit(key_cache.scalar_type()), "key_scales and value_scales go with an 8-bit "
              "cache (int8 or float8_e4m3fn), but the caches are ", key_cache.scalar_type());
  for (const auto* t : {&key_scales, &value_scales}) {
    const char* name = t == &key_scales ? "key_scales" : "value_scales";
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                name, " must be a contiguous float32 CPU tensor, got ", t->scalar_type(), " on ",
                t->device());
    TORCH_CHECK(t->dim() == 3 && t->size(0) == c.num_blocks && t->size(1) == c.num_kv_heads &&
                t->size(2) == c.block_size, name, " must be [num_blocks, num_kv_heads, "
                "block_size] = [", c.num_blocks, ", ", c.num_kv_heads, ", ", c.block_size,
                "], got ", t->sizes());
  }
  return Scales{key_scales.data_ptr<float>(), value_scales.data_ptr<float>()};
}

at::Tensor paged_prefill_attention_8bit(at::Tensor query, at::Tensor key_cache,
                                           at::Tensor value_cache, at::Tensor key_scales,
                                           at::Tensor value_scales,
                                           at::Tensor block_tables,
                                           at::Tensor query_start_loc,
                                           at::Tensor context_lens, double scale,
                                           int64_t window) {
  const CacheShape c = check_caches(key_cache, value_cache);
  const Scales scales = check_scales(key_cache, key_scales, value_scales, c);
  return attend_all(query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                    scale, c, &scales, window);
}

at::Tensor paged_attention_8bit(at::Tensor query, at::Tensor key_cache,
                                   at::Tensor value_cache, at::Tensor key_scales,
                                   at::Tensor value_scales, at::Tensor block_tables,
                                   at::Tensor context_lens, double scale, int64_t window) {
  return paged_prefill_attention_8bit(query, key_cache, value_cache, key_scales, value_scales,
                                      block_tables, decode_query_start_loc(query, context_lens),
                                      context_lens, scale, window);
}

// One vector (head_size numbers) to codes: scale = max |x| / the largest code (1 if all are 0),
// code = x / scale rounded (the torch reference, minipaged/kernels/kv_quant.py, does the same
// divisions, so both write the same bits).
// store(d, code) puts element d's code where the layout wants it; returns the scale.
template <typename T, typename C, typename Store>
float quantize_vector(const T* src, int64_t n, Store&& store) {
  constexpr bool is_int8 = std::is_same<C, int8_t>::value;
  const float qmax = is_int8 ? INT8_MAX_CODE : FP8_MAX;
  float amax = 0.f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(to_float(src[d])));
  const float scale = amax > 0.f ? amax / qmax : 1.f;
  for (int64_t d = 0; d < n; ++d) {
    const float y = std::min(std::max(to_float(src[d]) / scale, -qmax), qmax);
    if constexpr (is_int8) {
      store(d, static_cast<int8_t>(std::nearbyint(y)));  // half to even
    } else {
      store(d, c10::Float8_e4m3fn(y));  // torch's own rounding: nearest even
    }
  }
  return scale;
}

template <typename T, typename C>
void reshape_and_cache_8bit_impl(const at::Tensor& key, const at::Tensor& value,
                                 at::Tensor& key_cache, at::Tensor& value_cache,
                                 float* key_scales, float* value_scales,
                                 const at::Tensor& slot_mapping) {
  constexpr int X = 16 / sizeof(C);
  const int64_t num_kv_heads = key.size(1), head_size = key.size(2);
  const int64_t block_size = key_cache.size(3);
  const int64_t block_stride = key_cache.stride(0), head_stride = key_cache.stride(1);
  C* kc = key_cache.data_ptr<C>();
  C* vc = value_cache.data_ptr<C>();
  for_each_slot(slot_mapping, num_kv_heads, block_size,
                [&](int64_t token, int64_t h, int64_t block, int64_t offset) {
    const T* k_src = key.data_ptr<T>() + token * key.stride(0) + h * key.stride(1);
    const T* v_src = value.data_ptr<T>() + token * value.stride(0) + h * value.stride(1);
    C* k_dst = kc + block * block_stride + h * head_stride;  // [head_size / X][block][X]
    C* v_dst = vc + block * block_stride + h * head_stride;  // [head_size][block]
    const int64_t s = (block * num_kv_heads + h) * block_size + offset;  // its scale's index
    key_scales[s] = quantize_vector<T, C>(k_src, head_size, [&](int64_t d, C code) {
      k_dst[((d / X) * block_size + offset) * X + d % X] = code;
    });
    value_scales[s] = quantize_vector<T, C>(v_src, head_size, [&](int64_t d, C code) {
      v_dst[d * block_size + offset] = code;
    });
  });
}

void reshape_and_cache_8bit(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor key_scales,
                            at::Tensor value_scales, at::Tensor slot_mapping) {
  const CacheShape c = check_caches(key_cache, value_cache);
  const Scales scales = check_scales(key_cache, key_scales, value_scales, c);
  check_new_tokens(key, value, slot_mapping, c);
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key is ", key.scalar_type(),
              " but value is ", value.scalar_type());
  dispatch_code(key_cache.scalar_type(), [&](auto code) {
    using C = decltype(code);
    MINIPAGED_DISPATCH_DTYPE(key.scalar_type(), "reshape_and_cache_8bit", [&] {
      reshape_and_cache_8bit_impl<scalar_t, C>(key, value, key_cache, value_cache,
                                               const_cast<float*>(scales.key),
                                               const_cast<float*>(scales.value), slot_mapping);
    });
  });
}

// y = x W^T for a few rows (linear.cpp, lesson 15)
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight);
// y = x W^T with W's GGUF blocks dequantized inside the dot product (gguf_linear.cpp, issue 58)
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format);
// the same for a batch of rows: dequantized tiles of rows and linear.cpp's loop (gguf_linear.cpp)
at::Tensor gguf_linear_tiled(const at::Tensor& x, const at::Tensor& blocks, int64_t format);
// a matrix of GGUF blocks as float32, for BLAS on steps of many rows (gguf_linear.cpp)
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t format);
// the same for GGUF's blocks of 256 weights, Q4_K and Q6_K (gguf_kquants.cpp)
at::Tensor gguf_kquant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format);
// a LLaMA block's element-wise layers in float32 (layers.cpp)
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                     const at::Tensor& weight, double eps);
std::vector<at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& cos,
                               const at::Tensor& sin);

}  // namespace minipaged_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "minipaged: paged attention, a few-row linear and element-wise layers on the CPU";
  namespace py = pybind11;
  // window (last, 0 by default: the whole context): a sliding window's tokens
  m.def("paged_attention", &minipaged_cpu::paged_attention,
        "decode: one query per sequence over its paged KV cache", py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0);
  m.def("paged_prefill_attention", &minipaged_cpu::paged_prefill_attention,
        "each sequence's newest query rows, causal, over its paged KV cache", py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("query_start_loc"), py::arg("context_lens"), py::arg("scale"),
        py::arg("window") = 0);
  m.def("reshape_and_cache", &minipaged_cpu::reshape_and_cache,
        "write new keys and values into their cache slots");
  m.def("paged_attention_8bit", &minipaged_cpu::paged_attention_8bit,
        "decode over an 8-bit paged KV cache (codes and per-token scales)", py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("key_scales"),
        py::arg("value_scales"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("window") = 0);
  m.def("paged_prefill_attention_8bit", &minipaged_cpu::paged_prefill_attention_8bit,
        "causal rows over an 8-bit paged KV cache", py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("key_scales"), py::arg("value_scales"),
        py::arg("block_tables"), py::arg("query_start_loc"), py::arg("context_lens"),
        py::arg("scale"), py::arg("window") = 0);
  m.def("reshape_and_cache_8bit", &minipaged_cpu::reshape_and_cache_8bit,
        "quantize new keys and values into an 8-bit cache, one scale per token and kv head");
  m.def("linear", &minipaged_cpu::linear, "x W^T in float32, for a few rows of x",
        py::arg("x"), py::arg("weight"));
  m.def("gguf_linear", &minipaged_cpu::gguf_linear,
        "x W^T in float32, W as GGUF blocks (Q4_1 = 3, Q8_0 = 8) dequantized in the dot product",
        py::arg("x"), py::arg("blocks"), py::arg("format"));
  m.def("gguf_linear_tiled", &minipaged_cpu::gguf_linear_tiled,
        "x W^T for a batch of rows: tiles of W's rows dequantized, then the few-row float loop",
        py::arg("x"), py::arg("blocks"), py::arg("format"));
  m.def("gguf_dequantize", &minipaged_cpu::gguf_dequantize,
        "GGUF blocks (Q4_1 = 3, Q5_0 = 6, Q8_0 = 8) as float32 weights, (out, in)",
        py::arg("blocks"), py::arg("format"));
  m.def("gguf_kquant_linear", &minipaged_cpu::gguf_kquant_linear,
        "x W^T in float32, W as GGUF blocks (Q4_K = 12, Q6_K = 14) dequantized in the dot product",
        py::arg("x"), py::arg("blocks"), py::arg("format"));
  m.def("silu_and_mul", &minipaged_cpu::silu_and_mul, "silu(gate) * up, float32");
  m.def("rms_norm", &minipaged_cpu::rms_norm, "weight * x / sqrt(mean(x^2) + eps), float32");
  m.def("add_rms_norm", &minipaged_cpu::add_rms_norm,
        "(rms_norm(x + residual), x + residual), float32");
  m.def("rotary", &minipaged_cpu::rotary, "q and k rotated by their positions (RoPE), float32");
}
#endif  // MINIPAGED_KERNELS_ONLY
