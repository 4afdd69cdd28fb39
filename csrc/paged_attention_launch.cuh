// The launches of each kernel and the switch over every built (dtype, head size, block size).
// Part of paged_attention.cu, included by it once per translation unit (no include guard).
// The CPU builds paste it into that file (minipaged/kernels/cuda_on_cpu.py).

namespace minipaged {

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
// unit of the grouped instances (paged_attention_instances.cuh).
int launch_grouped_any(const AttentionArgs& a, int dtype, int head_size, int block_size);


}  // namespace minipaged
