// The program of lesson 06's kernel exercise (minipaged/lab/kernel_exercise.py): reads one case
// from a file, runs the V1 kernel built with the learner's phase 3, and writes the output and
// what every thread of every CUDA block ended phase 3 with (its max_logit and exp_sum).
//
// Built with -fsanitize=thread or -fsanitize=address; every buffer has its exact size, so a read
// past one is an AddressSanitizer error, and a missing barrier a ThreadSanitizer data race.
//
// Input (native byte order): int32 num_seqs, num_heads, num_kv_heads, num_blocks,
// max_blocks_per_seq, max_context_len; float32 scale; int32 context_lens[num_seqs],
// block_tables[num_seqs * max_blocks_per_seq]; float32 query, key_cache, value_cache.
// Output: int32 status; float32 out[num_seqs * num_heads * 64],
// thread_max and thread_sum[num_seqs * num_heads * 128]; then, when arguments 3 to 5 name a
// CUDA block (head, sequence) and a warp, int32 count and count records of that warp's shuffles
// (int32 lane, int32 source lane, uint32 sent, uint32 received: float32 bits).

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <vector>

extern "C" int exercise_paged_attention_v1(
    float* out, const float* query, const float* key_cache, const float* value_cache,
    const int* block_tables, const int* context_lens, int num_seqs, int num_heads,
    int num_kv_heads, int max_blocks_per_seq, int max_context_len, float scale,
    float* thread_max, float* thread_sum);

namespace {

template <typename T>
bool read(std::FILE* f, std::vector<T>& v) {
  return std::fread(v.data(), sizeof(T), v.size(), f) == v.size();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && argc != 6) {
    std::fprintf(stderr, "usage: %s INPUT OUTPUT [HEAD SEQUENCE WARP]\n", argv[0]);
    return 2;
  }
  constexpr int HEAD_SIZE = 64, BLOCK_SIZE = 16, THREADS = 128;
  std::FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 2;
  std::vector<int32_t> shape(6);
  std::vector<float> scale(1);
  if (!read(in, shape) || !read(in, scale)) return 2;
  const int num_seqs = shape[0], num_heads = shape[1], num_kv_heads = shape[2];
  const int num_blocks = shape[3], max_blocks_per_seq = shape[4], max_context_len = shape[5];
  std::vector<int32_t> context_lens(num_seqs), block_tables((size_t)num_seqs * max_blocks_per_seq);
  std::vector<float> query((size_t)num_seqs * num_heads * HEAD_SIZE);
  std::vector<float> key_cache((size_t)num_blocks * num_kv_heads * HEAD_SIZE * BLOCK_SIZE);
  std::vector<float> value_cache(key_cache.size());
  if (!read(in, context_lens) || !read(in, block_tables) || !read(in, query) ||
      !read(in, key_cache) || !read(in, value_cache)) {
    return 2;
  }
  std::fclose(in);
  std::vector<float> out(query.size());
  std::vector<float> thread_max((size_t)num_seqs * num_heads * THREADS);
  std::vector<float> thread_sum(thread_max.size());
  if (argc == 6) {
    cuda_on_cpu::trace_warp(dim3(std::atoi(argv[3]), std::atoi(argv[4]), 0), std::atoi(argv[5]));
  }
  const int32_t status = exercise_paged_attention_v1(
      out.data(), query.data(), key_cache.data(), value_cache.data(), block_tables.data(),
      context_lens.data(), num_seqs, num_heads, num_kv_heads, max_blocks_per_seq,
      max_context_len, scale[0], thread_max.data(), thread_sum.data());
  std::FILE* f = std::fopen(argv[2], "wb");
  if (!f) return 2;
  std::fwrite(&status, sizeof(status), 1, f);
  std::fwrite(out.data(), sizeof(float), out.size(), f);
  std::fwrite(thread_max.data(), sizeof(float), thread_max.size(), f);
  std::fwrite(thread_sum.data(), sizeof(float), thread_sum.size(), f);
  if (argc == 6) {
    const std::vector<cuda_on_cpu::ShuffleRecord> records = cuda_on_cpu::take_warp_trace();
    const int32_t count = (int32_t)records.size();
    std::fwrite(&count, sizeof(count), 1, f);
    for (const auto& r : records) {
      const int32_t row[4] = {r.lane, r.src_lane, (int32_t)(uint32_t)r.sent,
                              (int32_t)(uint32_t)r.received};
      std::fwrite(row, sizeof(int32_t), 4, f);
    }
  }
  std::fclose(f);
  return 0;
}
