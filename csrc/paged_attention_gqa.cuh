// Version 3 (lesson 05): the grouped-query kernel, one CUDA block per kv head's group.
// Part of paged_attention.cu, included by it once per translation unit (no include guard).
// The CPU builds paste it into that file (minipaged/kernels/cuda_on_cpu.py).

namespace minipaged {

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


}  // namespace minipaged
