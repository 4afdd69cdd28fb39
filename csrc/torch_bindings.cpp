// The one torch-facing file: it checks tensors, finds the current CUDA stream and calls the
// plain-CUDA launchers of paged_attention.cu and cache_kernels.cu (which know nothing of torch).
// minipaged/kernels/build.py builds this file with torch.utils.cpp_extension and
// minipaged/kernels/cuda_kernels.py wraps it.
//
// The same file binds the CPU build of the kernels (minipaged/kernels/cuda_on_cpu.py, with
// MINIPAGED_CUDA_ON_CPU defined): there the "device" tensors are CPU tensors, there are no
// streams, and a few extra functions choose the emulated GPU and read its counters.

#include <torch/extension.h>
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#ifdef MINIPAGED_CUDA_ON_CPU
namespace {
constexpr auto kDeviceType = at::kCPU;
constexpr const char* kDeviceName = "CPU (the CUDA-on-CPU build)";
constexpr bool kPinnedHostMemory = false;  // no CUDA in this torch: nothing to pin for
struct DeviceGuard {
  explicit DeviceGuard(const at::Device&) {}
};
cudaStream_t current_stream() { return nullptr; }
std::string error_detail() {
  const std::string detail = cuda_on_cpu::last_error_detail();
  return detail.empty() ? "" : " (" + detail + ")";
}
// set_host_checks(false) skips the checks that read context_lens, block_tables and slot_mapping,
// as they are skipped on a GPU (there they would cost a synchronisation): so that tests can see
// what the kernels themselves do with such input.
bool g_host_checks = true;
bool check_host_data(const torch::Tensor& t) { return g_host_checks && t.device().is_cpu(); }
}  // namespace
#else
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
namespace {
constexpr auto kDeviceType = at::kCUDA;
constexpr const char* kDeviceName = "CUDA";
constexpr bool kPinnedHostMemory = true;
using DeviceGuard = c10::cuda::CUDAGuard;
cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
std::string error_detail() { return ""; }
bool check_host_data(const torch::Tensor& t) { return t.device().is_cpu(); }
}  // namespace
#endif

#include "kernels.h"

namespace {

constexpr int kMaxGridY = 65535;  // CUDA's limit on gridDim.y: one row of the grid per sequence

// Turn a launcher's return code into a Python RuntimeError.
void check_code(int code, const std::string& what) {
  if (code == 0) return;
  std::string why;
  switch (code) {
    case -1: why = "unsupported dtype or element size"; break;
    case -2: why = "unsupported head size (built for 64, 80, 96, 112, 128, 256)"; break;
    case -3: why = "unsupported block size (built for 8, 16, 32)"; break;
    case -4: why = "not enough shared memory on this GPU"; break;
    case -5: why = "more than 65535 sequences (or partitions) for one launch"; break;
    case -6: why = "the caches must be 16-byte aligned, with 16-byte multiples as strides"; break;
    case -7: why = "the workspace is too small"; break;
    case -8: why = "num_heads must be a multiple of num_kv_heads"; break;
    case -9: why = "version must be 0 (choose), 1, 2 or 3 (grouped)"; break;
    case -10: why = "a forced partition size must be 0 or a power of two from 64 to 512"; break;
    case -11: why = "the grouped kernel (version 3) is built for at most 8 query heads per kv "
                    "head, head sizes 64 and 128 and a 16- or 32-bit cache"; break;
    case -12: why = "the reduce mode must be 0 (a reduce kernel) or 1 (fused)"; break;
    case -13: why = "window must be a number of tokens >= 0 (0: the whole context)"; break;
    case -14: why = "unsupported GGUF block format"; break;
    case -15: why = "in_features is not a whole number of the format's blocks"; break;
    default:
      why = code > 0 ? std::string("CUDA error: ") +
                           cudaGetErrorString(static_cast<cudaError_t>(code)) + error_detail()
                     : "error code " + std::to_string(code);
  }
  TORCH_CHECK(false, "minipaged ", what, ": ", why);
}

int dtype_code(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: TORCH_CHECK(false, "minipaged: unsupported dtype ", t.scalar_type(),
                         " (float32, float16 and bfloat16 only)");
  }
  return -1;
}

bool on_device(const torch::Tensor& t) { return t.device().type() == kDeviceType; }

void check_device(const torch::Tensor& t, const char* name, const torch::Device& device) {
  TORCH_CHECK(on_device(t), name, " must be a ", kDeviceName, " tensor, got ", t.device());
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), ", expected ", device);
}

bool aligned16(const torch::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// key_cache [num_blocks, num_kv_heads, head_size / x, block_size, x] and
// value_cache [num_blocks, num_kv_heads, head_size, block_size], same dtype. Each block of a
// kv head must be contiguous; the block and head strides are the caches' own (a cache may be a
// view, e.g. one layer of a bigger tensor) as long as they keep the 16-byte alignment.
void check_caches(const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                  int64_t head_size) {
  TORCH_CHECK(key_cache.dim() == 5, "key_cache must be [num_blocks, num_kv_heads, head_size/x, "
              "block_size, x], got ", key_cache.sizes());
  TORCH_CHECK(value_cache.dim() == 4, "value_cache must be [num_blocks, num_kv_heads, head_size, "
              "block_size], got ", value_cache.sizes());
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(),
              "key_cache and value_cache must have the same dtype");
  const int64_t x = 16 / key_cache.element_size();
  TORCH_CHECK(key_cache.size(4) == x, "key_cache's last dimension must be x = 16 / element size = ",
              x, ", got ", key_cache.size(4));
  TORCH_CHECK(key_cache.size(2) * x == head_size, "key_cache holds head size ",
              key_cache.size(2) * x, " (", key_cache.size(2), " x ", x, ") but the query's is ",
              head_size);
  TORCH_CHECK(value_cache.size(2) == head_size, "value_cache holds head size ",
              value_cache.size(2), " but the query's is ", head_size);
  TORCH_CHECK(value_cache.size(0) == key_cache.size(0) && value_cache.size(1) == key_cache.size(1)
              && value_cache.size(3) == key_cache.size(3),
              "key_cache ", key_cache.sizes(), " and value_cache ", value_cache.sizes(),
              " disagree");
  const int64_t block_size = key_cache.size(3);
  TORCH_CHECK(key_cache.stride(4) == 1 && key_cache.stride(3) == x &&
              key_cache.stride(2) == block_size * x,
              "each kv head's block of key_cache must be contiguous, got strides ",
              key_cache.strides());
  TORCH_CHECK(value_cache.stride(3) == 1 && value_cache.stride(2) == block_size,
              "each kv head's block of value_cache must be contiguous, got strides ",
              value_cache.strides());
  const int64_t e = key_cache.element_size();
  TORCH_CHECK(aligned16(key_cache) && aligned16(value_cache) &&
              key_cache.stride(0) * e % 16 == 0 && key_cache.stride(1) * e % 16 == 0 &&
              value_cache.stride(0) * e % 16 == 0 && value_cache.stride(1) * e % 16 == 0,
              "key_cache and value_cache must start on 16-byte boundaries and keep every block "
              "of every head on one (the kernels read them in 16-byte vectors)");
}

void check_window(int64_t window) {
  TORCH_CHECK(window >= 0 && window <= INT32_MAX, "window must be a number of tokens >= 0 "
              "(0: the whole context), got ", window);
}

// out, query [num_seqs, num_heads, head_size], the caches, block_tables, context_lens (on the
// host: every block a context uses), max_context_len and version of a decode call, for both
// paged_attention's. Returns false when there is nothing to compute.
bool check_decode_batch(const torch::Tensor& out, const torch::Tensor& query,
                        const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                        const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                        int64_t max_context_len, int64_t version) {
  const auto device = query.device();
  check_device(query, "query", device);
  check_device(out, "out", device);
  check_device(key_cache, "key_cache", device);
  check_device(value_cache, "value_cache", device);
  check_device(block_tables, "block_tables", device);
  check_device(context_lens, "context_lens", device);
  TORCH_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_size]");
  TORCH_CHECK(query.stride(2) == 1, "query's last dimension must be contiguous");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  check_caches(key_cache, value_cache, head_size);
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() &&
              out.scalar_type() == query.scalar_type(),
              "out must be a contiguous tensor shaped and typed like query");
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(3);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK(num_seqs <= kMaxGridY, "paged_attention takes at most ", kMaxGridY,
              " sequences per call (CUDA's grid limit), got ", num_seqs);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
              block_tables.is_contiguous() && block_tables.size(0) == num_seqs,
              "block_tables must be contiguous int32 [num_seqs, max_blocks_per_seq]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 &&
              context_lens.is_contiguous() && context_lens.size(0) == num_seqs,
              "context_lens must be contiguous int32 [num_seqs]");
  TORCH_CHECK(version >= 0 && version <= 3, "version must be 0 (choose), 1, 2 or 3 (grouped), got ",
              version);
  if (num_seqs == 0 || num_heads == 0) return false;
  TORCH_CHECK(max_context_len >= 1 && max_context_len <= INT32_MAX,
              "max_context_len must be in [1, 2^31), got ", max_context_len,
              " (every sequence attends to at least its own token)");
  const int64_t blocks_needed = (max_context_len + block_size - 1) / block_size;
  TORCH_CHECK(block_tables.size(1) >= blocks_needed, "block_tables has ", block_tables.size(1),
              " columns but max_context_len = ", max_context_len, " needs ", blocks_needed,
              " blocks of ", block_size, " tokens");
  if (check_host_data(context_lens)) {
    // Host data: check every sequence. On a GPU this would cost a synchronisation; there the
    // kernel writes zeros for an empty context and NaN for a context that is negative or longer
    // than max_context_len (paged_attention.cu, fill_row).
    const int* lens = context_lens.data_ptr<int>();
    const int* tables = block_tables.data_ptr<int>();
    const int64_t width = block_tables.size(1), num_blocks = key_cache.size(0);
    for (int64_t s = 0; s < num_seqs; ++s) {
      TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_context_len, "context_lens[", s, "] = ",
                  lens[s], " is outside [1, max_context_len = ", max_context_len, "]");
      for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b) {
        const int block = tables[s * width + b];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", s, ", ", b, "] = ", block,
                    " is not a block of the cache (", num_blocks, " blocks)");
      }
    }
  }
  return true;
}

// The kernel version that runs for a decode batch (*chosen) and its workspace on the device.
// (The kernel call then gets the same `version` and makes the same plan.) cache_dtype as
// minipaged_paged_attention_plan takes it.
torch::Tensor plan_decode(const torch::Tensor& query, const torch::Tensor& key_cache,
                          int cache_dtype, int64_t max_context_len, int64_t version, int* chosen,
                          int64_t* workspace_bytes) {
  int partition_size = 0;
  check_code(minipaged_paged_attention_plan((int)query.size(0), (int)query.size(1),
                                            (int)key_cache.size(1), (int)query.size(2),
                                            (int)max_context_len, cache_dtype, (int)version,
                                            chosen, &partition_size, workspace_bytes),
             "paged_attention");
  return torch::empty({(*workspace_bytes + 3) / 4}, query.options().dtype(torch::kFloat));
}

// ---------------------------------------------------------------------------------------------
// version: 0 = chosen (make_plan in paged_attention.cu), 1 = V1, 2 = V2 (partitioned),
// 3 = grouped (one CUDA block per kv head for all its query heads). window: a sliding window's
// tokens, 0 = the whole context. Returns the version that ran.
int64_t paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                        torch::Tensor value_cache, torch::Tensor block_tables,
                        torch::Tensor context_lens, double scale, int64_t max_context_len,
                        int64_t version, int64_t window) {
  check_window(window);
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(),
              "query and the caches must have the same dtype");
  if (!check_decode_batch(out, query, key_cache, value_cache, block_tables, context_lens,
                          max_context_len, version)) {
    return 0;
  }
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(3);
  const auto device = query.device();
  const int dtype = dtype_code(query);

  int chosen = 0;
  int64_t workspace_bytes = 0;
  const DeviceGuard guard(device);  // (the plan reads the current device's SM count)
  const auto workspace = plan_decode(query, key_cache, dtype, max_context_len, version, &chosen,
                                     &workspace_bytes);
  const int code = minipaged_paged_attention(
      out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
      block_tables.data_ptr<int>(), context_lens.data_ptr<int>(), (int)num_seqs, (int)num_heads,
      (int)num_kv_heads, (int)head_size, (int)block_size, (int)block_tables.size(1),
      query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
      value_cache.stride(0), value_cache.stride(1), (float)scale, (int)max_context_len,
      (int)window, dtype, (int)version, workspace.data_ptr(), workspace_bytes, current_stream());
  if (code == -4 && chosen == 1) {
    int64_t static_bytes = 0, longest = 0;
    minipaged_paged_attention_v1_limits((int)head_size, (int)block_size, dtype, &static_bytes,
                                        &longest);
    TORCH_CHECK(false, "minipaged paged_attention: max_context_len = ", max_context_len,
                " tokens need more shared memory for V1's logits than this GPU gives one block;"
                " V1 takes at most ", longest, " tokens here (V2, version=2 or 0, has no limit)");
  }
  check_code(code, "paged_attention");
  return chosen;
}

// (version that would run, workspace bytes, partition size) for a batch on the current device;
// version 0 = choose; cache_dtype as minipaged_paged_attention_plan takes it.
std::vector<int64_t> paged_attention_plan(int64_t num_seqs, int64_t num_heads,
                                          int64_t num_kv_heads, int64_t head_size,
                                          int64_t max_context_len, int64_t cache_dtype,
                                          int64_t version) {
  int chosen = 0, partition_size = 0;
  int64_t workspace_bytes = 0;
  check_code(minipaged_paged_attention_plan((int)num_seqs, (int)num_heads, (int)num_kv_heads,
                                            (int)head_size, (int)max_context_len,
                                            (int)cache_dtype, (int)version, &chosen,
                                            &partition_size, &workspace_bytes),
             "paged_attention_plan");
  return {chosen, workspace_bytes, partition_size};
}

// (static shared bytes, longest context) of V1 on the current device; dtype as dtype_code.
std::vector<int64_t> paged_attention_v1_limits(int64_t head_size, int64_t block_size,
                                               int64_t dtype) {
  int64_t static_bytes = 0, longest = 0;
  check_code(minipaged_paged_attention_v1_limits((int)head_size, (int)block_size, (int)dtype,
                                                 &static_bytes, &longest),
             "paged_attention_v1_limits");
  return {static_bytes, longest};
}

// ---------------------------------------------------------------------------------------------
// The new tokens' key and value [num_tokens, num_kv_heads, head_size], the caches they go
// into and their slots (checked on the host when they are there): for both reshape_and_cache's.
void check_new_tokens(const torch::Tensor& key, const torch::Tensor& value,
                      const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                      const torch::Tensor& slot_mapping) {
  const auto device = key_cache.device();
  check_device(key, "key", device);
  check_device(value, "value", device);
  check_device(key_cache, "key_cache", device);
  check_device(value_cache, "value_cache", device);
  check_device(slot_mapping, "slot_mapping", device);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "key and value must both be [num_tokens, num_kv_heads, head_size]");
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_size = key.size(2);
  for (const auto* t : {&key, &value}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == head_size,
                "each token's key and value must be contiguous (a row view is fine)");
  }
  check_caches(key_cache, value_cache, head_size);
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "reshape_and_cache writes contiguous caches only");
  TORCH_CHECK(key_cache.size(1) == num_kv_heads, "the caches hold ", key_cache.size(1),
              " kv heads, the keys ", num_kv_heads);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
              slot_mapping.is_contiguous() && slot_mapping.size(0) == num_tokens,
              "slot_mapping must be contiguous int64 [num_tokens]");
  if (check_host_data(slot_mapping)) {
    // Host data: every slot in [0, slots), or -1 (not cached). On a GPU the kernel skips every
    // negative slot and trusts the others (a check would cost a synchronisation).
    const int64_t slots = key_cache.size(0) * key_cache.size(3);
    const int64_t* s = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < num_tokens; ++t) {
      TORCH_CHECK(s[t] >= -1 && s[t] < slots, "slot_mapping[", t, "] = ", s[t], " is outside the "
                  "cache's slots [0, ", slots, "); -1 marks a token that is not cached");
    }
  }
}

void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor slot_mapping) {
  check_new_tokens(key, value, key_cache, value_cache, slot_mapping);
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
              value.scalar_type() == key_cache.scalar_type(),
              "key, value and the caches must have the same dtype");
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_size = key.size(2);
  const DeviceGuard guard(key_cache.device());
  check_code(minipaged_reshape_and_cache(
                 key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                 slot_mapping.data_ptr<int64_t>(), (int)num_tokens, (int)num_kv_heads,
                 (int)head_size, (int)key_cache.size(3), (int)key_cache.size(4), key.stride(0),
                 value.stride(0), (int)key.element_size(), current_stream()),
             "reshape_and_cache");
}

// ---------------------------------------------------------------------------------------------
// block_pairs: int64 CPU tensor [num_pairs, 2] of (src, dst).
void copy_blocks(std::vector<torch::Tensor> key_caches, std::vector<torch::Tensor> value_caches,
                 torch::Tensor block_pairs) {
  TORCH_CHECK(key_caches.size() == value_caches.size() && !key_caches.empty(),
              "copy_blocks needs one key cache and one value cache per layer");
  TORCH_CHECK(block_pairs.device().is_cpu() && block_pairs.scalar_type() == at::kLong &&
              block_pairs.dim() == 2 && block_pairs.size(1) == 2,
              "block_pairs must be an int64 CPU tensor [num_pairs, 2]");
  const auto& first = key_caches[0];
  const auto device = first.device();
  const int64_t num_blocks = first.size(0);
  const int64_t num_layers = (int64_t)key_caches.size();
  const int64_t num_pairs = block_pairs.size(0);
  if (num_pairs == 0) return;
  const auto pairs = block_pairs.contiguous();
  TORCH_CHECK(pairs.min().item<int64_t>() >= 0 && pairs.max().item<int64_t>() < num_blocks,
              "copy_blocks: block numbers must be in [0, ", num_blocks, ")");

  // One host table [key pointers | value pointers | pairs], in pinned memory, moved to the GPU
  // with one asynchronous copy (the caching host allocator keeps it alive until the copy is done).
  auto table = torch::empty({2 * num_layers + 2 * num_pairs},
                            torch::TensorOptions().dtype(torch::kLong)
                                .pinned_memory(kPinnedHostMemory));
  int64_t* rows = table.data_ptr<int64_t>();
  for (int64_t l = 0; l < num_layers; ++l) {
    const auto& k = key_caches[l];
    const auto& v = value_caches[l];
    check_device(k, "key_caches[l]", device);
    check_device(v, "value_caches[l]", device);
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "caches must be contiguous");
    TORCH_CHECK(k.sizes() == first.sizes() && v.sizes() == value_caches[0].sizes() &&
                k.scalar_type() == first.scalar_type() &&
                v.scalar_type() == value_caches[0].scalar_type() && v.size(0) == num_blocks,
                "every layer's caches must have the same shape and dtype");
    rows[l] = reinterpret_cast<int64_t>(k.data_ptr());
    rows[num_layers + l] = reinterpret_cast<int64_t>(v.data_ptr());
  }
  std::memcpy(rows + 2 * num_layers, pairs.data_ptr<int64_t>(), 2 * num_pairs * sizeof(int64_t));

  const DeviceGuard guard(device);
  const auto on_gpu = table.to(device, /*non_blocking=*/true);
  const int64_t* gpu_rows = on_gpu.data_ptr<int64_t>();
  const int64_t key_block_bytes = first.numel() / num_blocks * first.element_size();
  const int64_t value_block_bytes =
      value_caches[0].numel() / num_blocks * value_caches[0].element_size();
  check_code(minipaged_copy_blocks(gpu_rows, gpu_rows + num_layers, gpu_rows + 2 * num_layers,
                                   (int)num_layers, (int)num_pairs, key_block_bytes,
                                   value_block_bytes, current_stream()),
             "copy_blocks");
}

// ---------------------------------------------------------------------------------------------
// dst[d] = src[s] for each (s, d) row of block_pairs (int64 CPU [num_pairs, 2]); one of src and
// dst may be a CPU tensor (pin it for asynchronous copies).
void swap_blocks(torch::Tensor src, torch::Tensor dst, torch::Tensor block_pairs) {
  TORCH_CHECK(on_device(src) || on_device(dst), "swap_blocks: src or dst must be a ",
              kDeviceName, " tensor");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() && src.dim() >= 1 &&
              src.sizes().slice(1) == dst.sizes().slice(1),
              "swap_blocks: src ", src.sizes(), " and dst ", dst.sizes(),
              " must hold blocks of the same shape and dtype");
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "swap_blocks: caches must be contiguous");
  TORCH_CHECK(block_pairs.device().is_cpu() && block_pairs.scalar_type() == at::kLong &&
              block_pairs.dim() == 2 && block_pairs.size(1) == 2,
              "block_pairs must be an int64 CPU tensor [num_pairs, 2]");
  const auto pairs = block_pairs.contiguous();
  if (pairs.numel() > 0) {
    const auto s = pairs.select(1, 0), d = pairs.select(1, 1);
    TORCH_CHECK(s.min().item<int64_t>() >= 0 && s.max().item<int64_t>() < src.size(0) &&
                d.min().item<int64_t>() >= 0 && d.max().item<int64_t>() < dst.size(0),
                "swap_blocks: source blocks must be in [0, ", src.size(0),
                ") and destination blocks in [0, ", dst.size(0), ")");
  }
  cudaMemcpyKind kind;
  if (on_device(src) && on_device(dst)) {
    kind = cudaMemcpyDeviceToDevice;
  } else if (on_device(src)) {
    kind = cudaMemcpyDeviceToHost;
  } else {
    kind = cudaMemcpyHostToDevice;
  }
  const auto device = on_device(src) ? src.device() : dst.device();
  const DeviceGuard guard(device);
  const int64_t block_bytes = src.size(0) == 0 ? 0 : src.numel() / src.size(0) * src.element_size();
  check_code(minipaged_swap_blocks(dst.data_ptr(), src.data_ptr(), block_bytes,
                                   pairs.data_ptr<int64_t>(), (int)pairs.size(0), (int)kind,
                                   current_stream()),
             "swap_blocks");
}

// ---------------------------------------------------------------------------------------------
// An 8-bit cache (lesson 18): int8 or float8_e4m3fn codes, and float32 scales
// [num_blocks, num_kv_heads, block_size] beside each cache.
int cache_dtype_code(const torch::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kChar: return 3;
    case at::kFloat8_e4m3fn: return 4;
    default: TORCH_CHECK(false, "minipaged: an 8-bit cache is int8 or float8_e4m3fn, got ",
                         cache.scalar_type());
  }
  return -1;
}

void check_scales(const torch::Tensor& key_cache, const torch::Tensor& key_scales,
                  const torch::Tensor& value_scales) {
  const auto device = key_cache.device();
  for (const auto* t : {&key_scales, &value_scales}) {
    const char* name = t == &key_scales ? "key_scales" : "value_scales";
    check_device(*t, name, device);
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                t->size(0) == key_cache.size(0) && t->size(1) == key_cache.size(1) &&
                t->size(2) == key_cache.size(3), name, " must be contiguous float32 [num_blocks, "
                "num_kv_heads, block_size] = [", key_cache.size(0), ", ", key_cache.size(1),
                ", ", key_cache.size(3), "], got ", t->scalar_type(), " ", t->sizes());
  }
}

int64_t paged_attention_8bit(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor key_scales,
                             torch::Tensor value_scales, torch::Tensor block_tables,
                             torch::Tensor context_lens, double scale, int64_t max_context_len,
                             int64_t version, int64_t window) {
  check_window(window);
  const int cache_dtype = cache_dtype_code(key_cache);
  check_scales(key_cache, key_scales, value_scales);
  if (!check_decode_batch(out, query, key_cache, value_cache, block_tables, context_lens,
                          max_context_len, version)) {
    return 0;
  }
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(3);
  const auto device = query.device();
  int chosen = 0;
  int64_t workspace_bytes = 0;
  const DeviceGuard guard(device);  // (the plan reads the current device's SM count)
  const auto workspace = plan_decode(query, key_cache, cache_dtype, max_context_len, version,
                                     &chosen, &workspace_bytes);
  check_code(minipaged_paged_attention_8bit(
                 out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                 key_scales.data_ptr<float>(), value_scales.data_ptr<float>(),
                 block_tables.data_ptr<int>(), context_lens.data_ptr<int>(), (int)num_seqs,
                 (int)num_heads, (int)num_kv_heads, (int)head_size, (int)block_size,
                 (int)block_tables.size(1), query.stride(0), query.stride(1),
                 key_cache.stride(0), key_cache.stride(1), value_cache.stride(0),
                 value_cache.stride(1), (float)scale, (int)max_context_len, (int)window,
                 dtype_code(query), cache_dtype, (int)version, workspace.data_ptr(), workspace_bytes,
                 current_stream()),
             "paged_attention_8bit (8-bit caches: head sizes 64, 128; block sizes 16, 32)");
  return chosen;
}

void reshape_and_cache_8bit(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor key_scales,
                            torch::Tensor value_scales, torch::Tensor slot_mapping) {
  check_new_tokens(key, value, key_cache, value_cache, slot_mapping);
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value must have one dtype");
  const int cache_dtype = cache_dtype_code(key_cache);
  check_scales(key_cache, key_scales, value_scales);
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_size = key.size(2);
  const DeviceGuard guard(key_cache.device());
  check_code(minipaged_reshape_and_cache_8bit(
                 key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                 key_scales.data_ptr<float>(), value_scales.data_ptr<float>(),
                 slot_mapping.data_ptr<int64_t>(), (int)num_tokens, (int)num_kv_heads,
                 (int)head_size, (int)key_cache.size(3), key.stride(0), value.stride(0),
                 dtype_code(key), cache_dtype, current_stream()),
             "reshape_and_cache_8bit");
}

// ---------------------------------------------------------------------------------------------
// The small operations between a LLaMA layer's matmuls (layer_kernels.cu, lesson 15)
// ---------------------------------------------------------------------------------------------
void check_rows(const torch::Tensor& t, const char* name, const torch::Tensor& like) {
  check_device(t, name, like.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the dtype of ", "x (",
              like.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [num_tokens, hidden] with a "
              "contiguous last dimension, got sizes ", t.sizes(), " strides ", t.strides());
  TORCH_CHECK(t.sizes() == like.sizes(), name, " must have x's shape ", like.sizes(), ", got ",
              t.sizes());
}

// out = weight * rms_norm(x); with `residual`: sum_out = x + residual, out = weight *
// rms_norm(sum_out). All [num_tokens, hidden] of one dtype; weight [hidden].
void rms_norm(torch::Tensor out, torch::Tensor x, c10::optional<torch::Tensor> residual,
              c10::optional<torch::Tensor> sum_out, torch::Tensor weight, double eps) {
  check_rows(x, "x", x);
  check_rows(out, "out", x);
  TORCH_CHECK(residual.has_value() == sum_out.has_value(),
              "rms_norm: residual and sum_out come together");
  if (residual.has_value()) {
    check_rows(*residual, "residual", x);
    check_rows(*sum_out, "sum_out", x);
  }
  check_device(weight, "weight", x.device());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be a contiguous [", x.size(1), "] tensor of x's dtype, got ",
              weight.sizes(), " ", weight.scalar_type());
  const DeviceGuard guard(x.device());
  check_code(minipaged_rms_norm(
                 out.data_ptr(), x.data_ptr(),
                 residual.has_value() ? residual->data_ptr() : nullptr,
                 sum_out.has_value() ? sum_out->data_ptr() : nullptr, weight.data_ptr(),
                 (float)eps, (int)x.size(0), (int)x.size(1), out.stride(0), x.stride(0),
                 residual.has_value() ? residual->stride(0) : 0,
                 sum_out.has_value() ? sum_out->stride(0) : 0, dtype_code(x), current_stream()),
             "rms_norm");
}

void check_heads(const torch::Tensor& t, const char* name, const torch::Tensor& like) {
  check_device(t, name, like.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have q's dtype");
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              " must be [num_tokens, heads, head_size] with contiguous heads, got sizes ",
              t.sizes(), " strides ", t.strides());
}

// q_out, k_out = q, k rotated by `positions` (int64 [num_tokens]) through the cos and sin
// tables [max_position, head_size] (q's dtype).
void rotary(torch::Tensor q_out, torch::Tensor k_out, torch::Tensor q, torch::Tensor k,
            torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  check_heads(q, "q", q);
  check_heads(k, "k", q);
  check_heads(q_out, "q_out", q);
  check_heads(k_out, "k_out", q);
  TORCH_CHECK(q_out.sizes() == q.sizes() && k_out.sizes() == k.sizes(),
              "q_out and k_out must have q's and k's shapes");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "q and k must have the same tokens and head size");
  TORCH_CHECK(q.size(2) % 2 == 0, "the head size must be even, got ", q.size(2));
  check_device(positions, "positions", q.device());
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == q.size(0) && positions.is_contiguous(),
              "positions must be a contiguous int64 [", q.size(0), "] tensor");
  for (const auto* table : {&cos, &sin}) {
    check_device(*table, "cos/sin", q.device());
    TORCH_CHECK(table->scalar_type() == q.scalar_type() && table->dim() == 2 &&
                    table->size(1) == q.size(2) && table->is_contiguous(),
                "cos and sin must be contiguous [max_position, ", q.size(2),
                "] tables of q's dtype");
  }
  if (check_host_data(positions) && positions.numel()) {
    const int64_t lo = positions.min().item<int64_t>(), hi = positions.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < cos.size(0), "positions must be in [0, ", cos.size(0),
                "), got ", lo, " .. ", hi);
  }
  const DeviceGuard guard(q.device());
  check_code(minipaged_rotary(q_out.data_ptr(), k_out.data_ptr(), q.data_ptr(), k.data_ptr(),
                              positions.data_ptr<int64_t>(), cos.data_ptr(), sin.data_ptr(),
                              (int)q.size(0), (int)q.size(1), (int)k.size(1), (int)q.size(2),
                              q.stride(0), k.stride(0), q_out.stride(0), k_out.stride(0),
                              dtype_code(q), current_stream()),
             "rotary");
}

// out = silu(gate) * up, elementwise: out contiguous; gate and up [rows, cols] with contiguous
// rows at any stride (the two halves of one [gate | up] matmul output), or contiguous of any shape.
void silu_and_mul(torch::Tensor out, torch::Tensor gate, torch::Tensor up) {
  for (const auto* t : {&out, &gate, &up}) {
    check_device(*t, "silu_and_mul's tensors", gate.device());
    TORCH_CHECK(t->scalar_type() == gate.scalar_type() && t->sizes() == gate.sizes(),
                "silu_and_mul: out, gate and up must have one shape and dtype");
  }
  TORCH_CHECK(out.is_contiguous(), "silu_and_mul: out must be contiguous");
  const bool rows = gate.dim() == 2 && gate.stride(1) == 1 && up.stride(1) == 1;
  TORCH_CHECK(rows || (gate.is_contiguous() && up.is_contiguous()),
              "silu_and_mul: gate and up must be contiguous, or [rows, cols] with contiguous "
              "rows, got strides ", gate.strides(), " and ", up.strides());
  const int64_t cols = gate.dim() == 0 ? 1 : gate.size(-1);
  const int64_t num_rows = cols == 0 ? 0 : gate.numel() / cols;
  const DeviceGuard guard(gate.device());
  check_code(minipaged_silu_and_mul(out.data_ptr(), gate.data_ptr(), up.data_ptr(), num_rows,
                                    cols, rows ? gate.stride(0) : cols, rows ? up.stride(0) : cols,
                                    dtype_code(gate), current_stream()),
             "silu_and_mul");
}

// ---------------------------------------------------------------------------------------------
// y = x W^T with W as the rows of GGUF blocks a file stores (gguf_matmul.cu, issue 58)
// ---------------------------------------------------------------------------------------------
struct GGUFFormat {
  int64_t type;  // the number a GGUF file writes
  const char* name;
  int64_t weights, bytes;  // per block
};
constexpr GGUFFormat kGGUFFormats[] = {
    {8, "Q8_0", 32, 34}, {3, "Q4_1", 32, 20}, {6, "Q5_0", 32, 22}, {12, "Q4_K", 256, 144},
    {14, "Q6_K", 256, 210}};

// x [rows, in_features] (a contiguous last dimension; float32, float16 or bfloat16), weight
// uint8 [out_features, bytes per row] of format ggml_type -> [rows, out_features] in x's dtype.
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor weight, int64_t ggml_type) {
  const GGUFFormat* fmt = nullptr;
  for (const auto& f : kGGUFFormats) fmt = f.type == ggml_type ? &f : fmt;
  TORCH_CHECK(fmt != nullptr, "gguf_linear: GGUF block format ", ggml_type, " is not "
              "supported: the kernel reads Q8_0 (8), Q4_1 (3), Q5_0 (6), Q4_K (12), Q6_K (14)");
  check_device(x, "gguf_linear: x", x.device());
  check_device(weight, "gguf_linear: weight", x.device());
  const int dtype = dtype_code(x);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "gguf_linear: x must be [rows, in_features] "
              "with a contiguous last dimension, got sizes ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "gguf_linear: weight must be a contiguous uint8 [out_features, bytes per row] "
              "tensor of blocks, got ", weight.scalar_type(), " ", weight.sizes(),
              weight.is_contiguous() ? "" : " (not contiguous)");
  const int64_t in = x.size(1), rows = x.size(0), out_features = weight.size(0);
  TORCH_CHECK(in % fmt->weights == 0, "gguf_linear: in_features = ", in, " is not a multiple of ",
              fmt->name, "'s ", fmt->weights, " weights per block");
  TORCH_CHECK(weight.size(1) == in / fmt->weights * fmt->bytes, "gguf_linear: weight rows hold ",
              weight.size(1), " bytes, but ", in, " inputs of ", fmt->name, " take ",
              in / fmt->weights * fmt->bytes, " (", in / fmt->weights, " blocks of ", fmt->bytes,
              ")");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(weight.data_ptr()) % 2 == 0,
              "gguf_linear: weight must start on an even address (its float16 scales)");
  TORCH_CHECK(rows <= INT32_MAX && out_features <= INT32_MAX && in <= INT32_MAX,
              "gguf_linear: rows, in_features and out_features must each be below 2^31");
  auto out = torch::empty({rows, out_features}, x.options());
  const DeviceGuard guard(x.device());
  check_code(minipaged_gguf_linear(out.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                   (int)ggml_type, (int)rows, (int)out_features, (int)in,
                                   x.stride(0), dtype, current_stream()),
             "gguf_linear");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "minipaged CUDA kernels (see csrc/). Use them through minipaged.kernels.ops (or build.CUDA_OP.load()).";
  m.def("paged_attention", &paged_attention,
        "paged_attention(out, query, key_cache, value_cache, block_tables, context_lens, scale, "
        "max_context_len, version, window=0): single-query attention through block tables, "
        "written into out (window: a sliding window's tokens, 0 = the whole context); returns "
        "the version that ran (1, 2 or 3 = grouped)",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("max_context_len"), py::arg("version"), py::arg("window") = 0);
  m.def("paged_attention_plan", &paged_attention_plan,
        "paged_attention_plan(num_seqs, num_heads, num_kv_heads, head_size, max_context_len, "
        "cache_dtype, version) -> [version that runs, workspace bytes, partition size]");
  m.def("force_partition_size",
        [](int64_t tokens) { check_code(minipaged_force_partition_size((int)tokens),
                                        "force_partition_size"); },
        "force_partition_size(tokens): V2's partition size from now on (64, 128, 256 or 512), "
        "0 = the plan chooses (benchmarks)");
  m.def("set_v2_reduce",
        [](int64_t mode) { check_code(minipaged_set_v2_reduce((int)mode), "set_v2_reduce"); },
        "set_v2_reduce(mode): how V2 and version 3 combine partitions from now on: 0 = a reduce "
        "kernel (the default), 1 = fused into the partitions' last CUDA block (benchmarks)");
  m.def("paged_attention_v1_limits", &paged_attention_v1_limits,
        "paged_attention_v1_limits(head_size, block_size, dtype_code) -> [static shared bytes, "
        "longest context V1 takes]");
  m.def("reshape_and_cache", &reshape_and_cache,
        "reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)");
  m.def("paged_attention_8bit", &paged_attention_8bit,
        "paged_attention_8bit(out, query, key_cache, value_cache, key_scales, value_scales, "
        "block_tables, context_lens, scale, max_context_len, version, window=0): over an 8-bit "
        "cache",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("key_scales"), py::arg("value_scales"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("max_context_len"),
        py::arg("version"), py::arg("window") = 0);
  m.def("reshape_and_cache_8bit", &reshape_and_cache_8bit,
        "reshape_and_cache_8bit(key, value, key_cache, value_cache, key_scales, value_scales, "
        "slot_mapping): quantize into an 8-bit cache, one scale per token and kv head");
  m.def("copy_blocks", &copy_blocks, "copy_blocks(key_caches, value_caches, block_pairs)");
  m.def("rms_norm", &rms_norm,
        "rms_norm(out, x, residual, sum_out, weight, eps): out = weight * rms_norm(x), or with "
        "a residual sum_out = x + residual and out = weight * rms_norm(sum_out)");
  m.def("rotary", &rotary, "rotary(q_out, k_out, q, k, positions, cos, sin): rotate-half RoPE");
  m.def("silu_and_mul", &silu_and_mul, "silu_and_mul(out, gate, up): out = silu(gate) * up");
  m.def("swap_blocks", &swap_blocks, "swap_blocks(src, dst, block_pairs)");
  m.def("gguf_linear", &gguf_linear,
        "gguf_linear(x, weight, ggml_type) -> x W^T, W as uint8 rows of GGUF blocks (Q8_0, "
        "Q4_1, Q5_0, Q4_K, Q6_K) dequantized inside the dot product");
#ifdef MINIPAGED_CUDA_ON_CPU
  m.def("set_device", [](int device) { check_code((int)cudaSetDevice(device), "set_device"); },
        "the emulated GPU whose limits apply: 0 = H100 (sm_90), 1 = A100 (sm_80)");
  m.def("set_host_checks", [](bool enabled) { g_host_checks = enabled; },
        "set_host_checks(enabled): False skips the checks of context_lens, block_tables and "
        "slot_mapping contents, as on a GPU, to see what the kernels do with such input");
  m.def("set_block_order", [](int64_t order, int64_t seed) {
    TORCH_CHECK(order >= 0 && order <= 2, "set_block_order: order must be 0, 1 or 2");
    cuda_on_cpu::set_block_order(static_cast<cuda_on_cpu::BlockOrder>(order), (unsigned)seed);
  }, "set_block_order(order, seed): how later launches order their CUDA blocks: 0 = blockIdx "
     "order, 1 = reversed, 2 = shuffled (a new permutation per launch, drawn from seed)");
  m.def("counters", [] {
    const auto c = cuda_on_cpu::counters();
    return std::vector<int64_t>{c.launches, c.blocks, c.block_barriers, c.warp_exchanges};
  }, "[launches, CUDA blocks, __syncthreads calls, warp exchanges] so far");
  m.def("trace_warp", [](int64_t x, int64_t y, int64_t z, int64_t warp) {
    cuda_on_cpu::trace_warp(dim3((unsigned)x, (unsigned)y, (unsigned)z), (int)warp);
  }, "trace_warp(block_x, block_y, block_z, warp): record that warp's shuffles (warp < 0: stop)");
  m.def("take_warp_trace", [] {
    std::vector<std::vector<int64_t>> out;
    for (const auto& r : cuda_on_cpu::take_warp_trace()) {
      out.push_back({r.lane, r.src_lane, (int64_t)r.sent, (int64_t)r.received});
    }
    return out;
  }, "the recorded shuffles: [lane, source lane, sent bits, received bits] in lane order");
  m.def("trace_events", [](bool enabled) { cuda_on_cpu::trace_events(enabled); },
        "trace_events(enabled): clear the event record and start (True) or stop recording the "
        "MP_TRACE events of a traced build (an untraced build records none)");
  m.def("take_events", [] {
    const auto events = cuda_on_cpu::take_events();
    const int64_t n = (int64_t)events.size();
    auto ints = torch::empty({n, 7}, torch::kInt64);
    auto values = torch::empty({n}, torch::kFloat32);
    auto* i = ints.data_ptr<int64_t>();
    auto* v = values.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      const auto& e = events[r];
      const int64_t row[7] = {e.kind, e.block[0], e.block[1], e.block[2], e.thread, e.a, e.b};
      for (int k = 0; k < 7; ++k) i[r * 7 + k] = row[k];
      v[r] = e.value;
    }
    return std::make_tuple(ints, values);
  }, "the recorded events: (int64 [n, 7] = kind, blockIdx x, y, z, thread, a, b; float32 [n])");
#endif
}
