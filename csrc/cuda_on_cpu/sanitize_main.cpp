// The sanitizer program: small cases of every kernel in csrc/, built for the CPU with
// -fsanitize=thread or -fsanitize=address (minipaged/kernels/cuda_on_cpu.py build_sanitizer_program,
// run by tests/kernels/test_cuda_on_cpu_sanitizers.py). No Python and no torch in the process, so every
// report is about our code. Every buffer is allocated at its exact size, so a read past a cache,
// a block table or shared memory is an AddressSanitizer error; every CUDA thread is a host
// thread, so a missing __syncthreads is a ThreadSanitizer data race.
//
// Prints one line per case and exits 0 when every output matches a plain double-precision
// reference; exits 1 otherwise. An argument runs only the cases whose name contains it
// (e.g. "V1 float32").

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "../kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>


namespace {

std::mt19937 rng(1234);
int failures = 0;
const char* only = nullptr;  // run only the cases whose name contains this
bool selected(const char* name) { return !only || std::strstr(name, only); }
const char* variant = "";  // appended to the attention cases' names (e.g. the fused reduce)

// Element types and their conversions.
float to_f(float v) { return v; }
float to_f(__half v) { return __half2float(v); }
float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> T from_f(float v);
template <> float from_f<float>(float v) { return v; }
template <> __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <typename T> int dtype_code();
template <> int dtype_code<float>() { return 0; }
template <> int dtype_code<__half>() { return 1; }
template <> int dtype_code<__nv_bfloat16>() { return 2; }
template <typename T> const char* dtype_name();
template <> const char* dtype_name<float>() { return "float32"; }
template <> const char* dtype_name<__half>() { return "float16"; }
template <> const char* dtype_name<__nv_bfloat16>() { return "bfloat16"; }

template <typename T>
std::vector<T> randn(size_t n) {
  std::normal_distribution<float> normal;
  std::vector<T> v(n);
  for (auto& e : v) e = from_f<T>(normal(rng));
  return v;
}

void report(const char* what, bool ok, double err) {
  std::printf("%-58s %s  (max relative error per sequence %.2e)\n", what, ok ? "ok" : "FAIL", err);
  if (!ok) ++failures;
}

// ---- paged attention ----------------------------------------------------------------------------
// version 3 is the grouped kernel: num_heads / num_kv_heads query heads per CUDA block.
template <typename T>
void attention_case(int version, std::vector<int> lens, double tolerance, int num_heads = 2,
                    int num_kv_heads = 1) {
  char what[128];
  std::snprintf(what, sizeof what, "paged_attention V%d %s, %d sequences up to %d tokens%s",
                version, dtype_name<T>(), (int)lens.size(),
                *std::max_element(lens.begin(), lens.end()), variant);
  if (!selected(what)) return;
  constexpr int head_size = 64, block_size = 16;
  constexpr int x = 16 / sizeof(T);
  const int num_seqs = (int)lens.size();
  int max_len = 0, max_blocks = 0, num_blocks = 0;
  for (int n : lens) {
    max_len = std::max(max_len, n);
    max_blocks = std::max(max_blocks, (n + block_size - 1) / block_size);
    num_blocks += (n + block_size - 1) / block_size;
  }
  // Blocks in reverse order, so that no sequence's blocks are in table order.
  std::vector<int> tables(num_seqs * max_blocks, -1);  // -1: padding, must never be read
  for (int s = 0, next = num_blocks - 1; s < num_seqs; ++s) {
    for (int b = 0; b < (lens[s] + block_size - 1) / block_size; ++b) {
      tables[s * max_blocks + b] = next--;
    }
  }
  const size_t block_elems = (size_t)num_kv_heads * head_size * block_size;
  auto key_cache = randn<T>(num_blocks * block_elems);
  auto value_cache = randn<T>(num_blocks * block_elems);
  auto query = randn<T>((size_t)num_seqs * num_heads * head_size);
  std::vector<T> out(query.size(), from_f<T>(NAN));
  const float scale = 1.f / std::sqrt((float)head_size);

  int chosen = 0, partition_size = 0;
  int64_t workspace_bytes = 0;
  minipaged_paged_attention_plan(num_seqs, num_heads, num_kv_heads, head_size, max_len,
                                 dtype_code<T>(), version, &chosen, &partition_size,
                                 &workspace_bytes);
  std::vector<float> workspace(workspace_bytes / sizeof(float));
  const int code = minipaged_paged_attention(
      out.data(), query.data(), key_cache.data(), value_cache.data(), tables.data(), lens.data(),
      num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks,
      num_heads * head_size, head_size, block_elems, (int64_t)head_size * block_size, block_elems,
      (int64_t)head_size * block_size, scale, max_len, /*window=*/0, dtype_code<T>(), version,
      workspace.empty() ? nullptr : workspace.data(), workspace_bytes, nullptr);

  double worst = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int* table = &tables[s * max_blocks];
    for (int h = 0; h < num_heads; ++h) {
      const int kv = h / (num_heads / num_kv_heads);
      if (lens[s] == 0) {  // an empty context: the kernels write zeros (not 0 / 0)
        bool zeros = true;
        for (int d = 0; d < head_size; ++d) {
          zeros = zeros && to_f(out[((size_t)s * num_heads + h) * head_size + d]) == 0.f;
        }
        worst = zeros ? worst : NAN;
        continue;
      }
      const T* q = &query[((size_t)s * num_heads + h) * head_size];
      std::vector<double> logits(lens[s]);
      double m = -1e300, sum = 0;
      for (int t = 0; t < lens[s]; ++t) {
        const T* k = &key_cache[table[t / block_size] * block_elems + kv * head_size * block_size];
        double dot = 0;
        for (int d = 0; d < head_size; ++d) {
          dot += (double)to_f(q[d]) * to_f(k[(d / x * block_size + t % block_size) * x + d % x]);
        }
        logits[t] = dot * scale;
        m = std::max(m, logits[t]);
      }
      for (double& l : logits) sum += (l = std::exp(l - m));
      double diff = 0, norm = 0;
      for (int d = 0; d < head_size; ++d) {
        double ref = 0;
        for (int t = 0; t < lens[s]; ++t) {
          const T* v = &value_cache[table[t / block_size] * block_elems +
                                    kv * head_size * block_size];
          ref += logits[t] / sum * to_f(v[d * block_size + t % block_size]);
        }
        const double got = to_f(out[((size_t)s * num_heads + h) * head_size + d]);
        diff += (got - ref) * (got - ref);
        norm += ref * ref;
      }
      const double err = std::sqrt(diff / norm);
      worst = std::isnan(err) || std::isnan(worst) ? NAN : std::max(worst, err);
    }
  }
  report(what, code == 0 && chosen == version && worst <= tolerance, worst);
  if (code) std::printf("  launcher returned %d: %s\n", code, cuda_on_cpu::last_error_detail());
}

// ---- the cache kernels ------------------------------------------------------------------------
// A failed launch whose error nobody read (someone else's): cudaGetLastError would return it.
// The launchers must clear it before their own launch instead of reporting it as theirs.
bool plant_stale_error() {
  cuda_on_cpu::detail::launch(nullptr, dim3(0), dim3(1), 0, {nullptr, nullptr});  // grid of 0
  return cudaPeekAtLastError() != cudaSuccess;
}

void cache_cases() {
  if (!selected("reshape_and_cache copy_blocks swap_blocks")) return;
  constexpr int num_tokens = 7, num_kv_heads = 2, head_size = 64, block_size = 16, x = 8;
  constexpr int num_blocks = 3;
  constexpr size_t block_elems = (size_t)num_kv_heads * head_size * block_size;
  auto key = randn<__half>(num_tokens * num_kv_heads * head_size);
  auto value = randn<__half>(num_tokens * num_kv_heads * head_size);
  std::vector<__half> key_cache(num_blocks * block_elems, from_f<__half>(0.f));
  std::vector<__half> value_cache(num_blocks * block_elems, from_f<__half>(0.f));
  const std::vector<int64_t> slots = {5, -1, 16, 47, 0, 31, 33};
  const bool planted = plant_stale_error();
  int code = minipaged_reshape_and_cache(key.data(), value.data(), key_cache.data(),
                                         value_cache.data(), slots.data(), num_tokens,
                                         num_kv_heads, head_size, block_size, x,
                                         num_kv_heads * head_size, num_kv_heads * head_size, 2,
                                         nullptr);
  bool ok = code == 0;
  for (int t = 0; t < num_tokens && ok; ++t) {
    if (slots[t] < 0) continue;
    const int64_t b = slots[t] / block_size, o = slots[t] % block_size;
    for (int h = 0; h < num_kv_heads; ++h) {
      for (int d = 0; d < head_size; ++d) {
        const size_t base = b * block_elems + (size_t)h * head_size * block_size;
        const size_t i = ((size_t)t * num_kv_heads + h) * head_size + d;
        ok = ok && key_cache[base + (d / x * block_size + o) * x + d % x].__x == key[i].__x &&
             value_cache[base + d * block_size + o].__x == value[i].__x;
      }
    }
  }
  report("reshape_and_cache float16", ok, 0);
  report("reshape_and_cache clears a stale error first", planted && code == 0, 0);

  // copy_blocks over two layers, then swap_blocks to a second pool
  std::vector<__half> key2 = key_cache, value2 = value_cache;
  const int64_t key_ptrs[2] = {(int64_t)key_cache.data(), (int64_t)key2.data()};
  const int64_t value_ptrs[2] = {(int64_t)value_cache.data(), (int64_t)value2.data()};
  const int64_t pairs[4] = {0, 2, 1, 0};
  const std::vector<__half> before = key_cache;
  const bool planted_again = plant_stale_error();
  code = minipaged_copy_blocks(key_ptrs, value_ptrs, pairs, 2, 2, block_elems * 2,
                               block_elems * 2, nullptr);
  ok = code == 0 &&
       std::memcmp(&key_cache[2 * block_elems], &before[0], block_elems * 2) == 0 &&
       std::memcmp(&key2[0], &before[block_elems], block_elems * 2) == 0;
  report("copy_blocks float16, 2 layers", ok, 0);
  report("copy_blocks clears a stale error first", planted_again && code == 0, 0);

  std::vector<__half> cpu(4 * block_elems);
  const int64_t swap_pairs[2] = {2, 3};
  code = minipaged_swap_blocks(cpu.data(), key_cache.data(), block_elems * 2, swap_pairs, 1,
                               cudaMemcpyDeviceToHost, nullptr);
  ok = code == 0 && std::memcmp(&cpu[3 * block_elems], &key_cache[2 * block_elems],
                                block_elems * 2) == 0;
  report("swap_blocks float16", ok, 0);
}

// ---- x W^T with W as GGUF blocks (gguf_matmul.cu) ------------------------------------------------
// Every format over exact-size blocks and rows (ragged: 5 rows of x, 7 weight rows, two blocks
// of 256 weights a row), the codes random and the float16 scales set to 1/64 (Q6_K's int8
// scales to 1): every output must be finite, and Q8_0's (w = d * q) equal a double reference.
void gguf_cases() {
  if (!selected("gguf_linear")) return;
  struct Format { int type, weights, bytes; std::vector<int> halves; const char* name; };
  const Format formats[] = {{8, 32, 34, {0}, "Q8_0"}, {3, 32, 20, {0, 2}, "Q4_1"},
                            {6, 32, 22, {0}, "Q5_0"}, {12, 256, 144, {0, 2}, "Q4_K"},
                            {14, 256, 210, {208}, "Q6_K"}};
  constexpr int rows = 5, out_features = 7, in_features = 512;
  const auto x = randn<float>((size_t)rows * in_features);
  std::uniform_int_distribution<int> byte(0, 255);
  for (const auto& f : formats) {
    const int blocks = in_features / f.weights;
    std::vector<uint8_t> w((size_t)out_features * blocks * f.bytes);
    for (auto& b : w) b = (uint8_t)byte(rng);
    const __half scale = from_f<__half>(1.f / 64);
    for (size_t b = 0; b < (size_t)out_features * blocks; ++b) {
      for (int at : f.halves) std::memcpy(&w[b * f.bytes + at], &scale, 2);
      if (f.type == 14) std::memset(&w[b * f.bytes + 192], 1, 16);
    }
    std::vector<float> y((size_t)rows * out_features);
    const int code = minipaged_gguf_linear(y.data(), x.data(), w.data(), f.type, rows,
                                           out_features, in_features, in_features, 0, nullptr);
    bool ok = code == 0;
    double err = 0;
    for (int r = 0; r < rows; ++r) {
      for (int n = 0; n < out_features; ++n) {
        const float got = y[(size_t)r * out_features + n];
        ok = ok && std::isfinite(got);
        if (f.type != 8) continue;
        double ref = 0, size = 0;
        for (int k = 0; k < in_features; ++k) {
          const double q = (int8_t)w[((size_t)n * blocks + k / 32) * 34 + 2 + k % 32] / 64.0;
          ref += q * x[(size_t)r * in_features + k];
          size += std::fabs(q * x[(size_t)r * in_features + k]);
        }
        err = std::max(err, std::fabs(got - ref) / size);
      }
    }
    char name[64];
    std::snprintf(name, sizeof name, "gguf_linear %s float32", f.name);
    report(name, ok && err < 1e-5, err);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) only = argv[1];
  attention_case<float>(1, {1, 17, 40}, 1e-5);
  attention_case<float>(2, {600, 7}, 1e-5);
  attention_case<__half>(1, {15, 33}, 2e-3);
  attention_case<__half>(2, {530}, 2e-3);
  attention_case<__nv_bfloat16>(1, {16, 3}, 1e-2);
  attention_case<__nv_bfloat16>(2, {520, 1}, 1e-2);
  attention_case<float>(1, {0, 20}, 1e-5);   // an empty context between real ones: zeros
  attention_case<float>(2, {530, 0}, 1e-5);
  // the grouped kernel, 3 query heads per kv head: one partition (it writes the output), and
  // several (V2's workspace and reduce kernel)
  attention_case<float>(3, {1, 17, 40}, 1e-5, 6, 2);
  attention_case<float>(3, {600, 7}, 1e-5, 6, 2);
  attention_case<__half>(3, {530}, 2e-3, 6, 2);
  attention_case<__nv_bfloat16>(3, {16, 3}, 1e-2, 6, 2);
  attention_case<float>(3, {0, 20}, 1e-5, 6, 2);
  attention_case<float>(3, {530, 0}, 1e-5, 6, 2);
  // The fused reduce (the partitions' last CUDA block combines them), its counters at the end
  // of the exact-size workspace; the blocks in a shuffled order, as a GPU may run them. 64-token
  // partitions: sequences of 10, 3, 1 and no partitions in one launch.
  minipaged_set_v2_reduce(1);
  minipaged_force_partition_size(64);
  cuda_on_cpu::set_block_order(cuda_on_cpu::SHUFFLED, 5);
  variant = ", fused reduce";
  attention_case<float>(2, {600, 130, 64, 0, 7}, 1e-5);
  attention_case<__half>(2, {530, 1}, 2e-3);
  attention_case<float>(3, {600, 130, 0, 7}, 1e-5, 6, 2);
  attention_case<__nv_bfloat16>(3, {200, 65}, 1e-2, 6, 2);
  cuda_on_cpu::set_block_order(cuda_on_cpu::IN_ORDER);
  minipaged_force_partition_size(0);
  minipaged_set_v2_reduce(0);
  cache_cases();
  gguf_cases();
  std::printf("%s\n", failures ? "FAILED" : "all cases passed");
  return failures ? 1 : 0;
}
