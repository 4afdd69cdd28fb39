// Lesson 06's exercise build, the launch: appended after csrc/paged_attention.cu up to its
// ">>> end of the exercise build" line, with the learner's phase 3 spliced in
// (minipaged/lab/kernel_exercise.py). V1 for one shape only: fp32, head size 64, block size 16,
// 128 threads, so that a learner's edit compiles in seconds. It continues inside the kernel
// file's namespace minipaged, and closes it.

extern "C" int exercise_paged_attention_v1(
    float* out, const float* query, const float* key_cache, const float* value_cache,
    const int* block_tables, const int* context_lens, int num_seqs, int num_heads,
    int num_kv_heads, int max_blocks_per_seq, int max_context_len, float scale,
    float* thread_max, float* thread_sum) {
  constexpr int HEAD_SIZE = 64, BLOCK_SIZE = 16, THREADS = 128, X = 4;  // X: fp32 per 16 bytes
  KernelArgs a;
  a.block_tables = block_tables;
  a.context_lens = context_lens;
  a.max_blocks_per_seq = max_blocks_per_seq;
  a.num_kv_heads = num_kv_heads;
  a.q_seq_stride = (int64_t)num_heads * HEAD_SIZE;
  a.q_head_stride = HEAD_SIZE;
  a.k_head_stride = (int64_t)(HEAD_SIZE / X) * BLOCK_SIZE * X;
  a.k_block_stride = num_kv_heads * a.k_head_stride;
  a.v_head_stride = (int64_t)HEAD_SIZE * BLOCK_SIZE;
  a.v_block_stride = num_kv_heads * a.v_head_stride;
  a.scale = scale;
  exercise_record::thread_max = thread_max;
  exercise_record::thread_sum = thread_sum;
  const int capacity = (max_context_len + BLOCK_SIZE - 1) / BLOCK_SIZE * BLOCK_SIZE;
  constexpr auto kernel = paged_attention_v1_kernel<float, HEAD_SIZE, BLOCK_SIZE, THREADS>;
  kernel<<<dim3(num_heads, num_seqs), THREADS, capacity * sizeof(float)>>>(
      out, query, key_cache, value_cache, a, capacity);
  return (int)cudaGetLastError();
}

}  // namespace minipaged
