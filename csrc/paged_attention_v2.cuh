// V2 (lesson 05): the context cut into partitions, one CUDA block each, and the reduce that
// combines them (a kernel of its own, or fused into the last partition's CUDA block).
// Part of paged_attention.cu, included by it once per translation unit (no include guard).
// The CPU builds paste it into that file (minipaged/kernels/cuda_on_cpu.py).

namespace minipaged {

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


}  // namespace minipaged
