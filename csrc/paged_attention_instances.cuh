// The extern "C" entry points, each in the part of the template instances that builds it.
// Part of paged_attention.cu, included by it once per translation unit (no include guard).
// The CPU builds paste it into that file (minipaged/kernels/cuda_on_cpu.py).


// ---- three translation units ------------------------------------------------------------------
// Every template instance of paged_attention.cu in one nvcc run took 78 s on this project's 2-core machine
// (2026-11-26). The GPU build compiles the file three times, each time instantiating one part:
// paged_attention.cu alone, the entry points of 16- and 32-bit caches (V1, V2); paged_attention_8bit.cu,
// the 8-bit cache's (lesson 18); paged_attention_grouped.cu, version 3. The CPU builds define
// MINIPAGED_ALL_PARTS and take everything from paged_attention.cu.
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
