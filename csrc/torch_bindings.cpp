// The one torch-facing file: it checks tensors, finds the current CUDA stream and calls the
// plain-CUDA launchers of paged_attention.cu and cache_kernels.cu (which know nothing of torch).
// minipaged/cuda_ops.py builds this file with torch.utils.cpp_extension and wraps it.

#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

extern "C" {
int minipaged_paged_attention(void* out, const void* query, const void* key_cache,
                              const void* value_cache, const int* block_tables,
                              const int* context_lens, int num_seqs, int num_heads,
                              int num_kv_heads, int head_size, int block_size,
                              int max_blocks_per_seq, int64_t q_seq_stride, int64_t q_head_stride,
                              int64_t kv_block_stride, int64_t kv_head_stride, float scale,
                              int max_context_len, int dtype, cudaStream_t stream);
int minipaged_paged_attention_max_context_len(int head_size, int dtype);
int minipaged_reshape_and_cache(const void* key, const void* value, void* key_cache,
                                void* value_cache, const int64_t* slot_mapping, int num_tokens,
                                int num_kv_heads, int head_size, int block_size, int x,
                                int64_t key_token_stride, int64_t value_token_stride,
                                int element_size, cudaStream_t stream);
int minipaged_copy_blocks(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                          const int64_t* block_pairs, int num_layers, int num_pairs,
                          int64_t key_block_bytes, int64_t value_block_bytes,
                          cudaStream_t stream);
int minipaged_swap_blocks(void* dst, const void* src, int64_t block_bytes,
                          const int64_t* block_pairs, int num_pairs, int kind,
                          cudaStream_t stream);
}

namespace {

// Turn a launcher's return code into a Python RuntimeError.
void check_code(int code, const std::string& what) {
  if (code == 0) return;
  std::string why;
  switch (code) {
    case -1: why = "unsupported dtype or element size"; break;
    case -2: why = "unsupported head size (built for 64, 80, 96, 128)"; break;
    case -3: why = "unsupported block size (built for 8, 16, 32)"; break;
    default:
      why = code > 0
                ? std::string("CUDA error: ") + cudaGetErrorString(static_cast<cudaError_t>(code))
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

void check_cuda(const torch::Tensor& t, const char* name, const torch::Device& device) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), ", expected ", device);
}

// key_cache [num_blocks, num_kv_heads, head_size / x, block_size, x] and
// value_cache [num_blocks, num_kv_heads, head_size, block_size], contiguous, same dtype.
void check_caches(const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                  int64_t head_size) {
  TORCH_CHECK(key_cache.dim() == 5, "key_cache must be [num_blocks, num_kv_heads, head_size/x, "
              "block_size, x], got ", key_cache.sizes());
  TORCH_CHECK(value_cache.dim() == 4, "value_cache must be [num_blocks, num_kv_heads, head_size, "
              "block_size], got ", value_cache.sizes());
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "key_cache and value_cache must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(),
              "key_cache and value_cache must have the same dtype");
  const int64_t x = 16 / key_cache.element_size();
  TORCH_CHECK(key_cache.size(4) == x, "key_cache's last dimension must be x = 16 / element size = ",
              x, ", got ", key_cache.size(4));
  TORCH_CHECK(key_cache.size(2) * x == head_size && value_cache.size(2) == head_size,
              "the caches do not hold head_size = ", head_size);
  TORCH_CHECK(value_cache.size(0) == key_cache.size(0) && value_cache.size(1) == key_cache.size(1)
              && value_cache.size(3) == key_cache.size(3),
              "key_cache ", key_cache.sizes(), " and value_cache ", value_cache.sizes(),
              " disagree");
}

// ---------------------------------------------------------------------------------------------
void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                     torch::Tensor value_cache, torch::Tensor block_tables,
                     torch::Tensor context_lens, double scale, int64_t max_context_len) {
  const auto device = query.device();
  check_cuda(query, "query", device);
  check_cuda(out, "out", device);
  check_cuda(key_cache, "key_cache", device);
  check_cuda(value_cache, "value_cache", device);
  check_cuda(block_tables, "block_tables", device);
  check_cuda(context_lens, "context_lens", device);
  TORCH_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_size]");
  TORCH_CHECK(query.stride(2) == 1, "query's last dimension must be contiguous");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  check_caches(key_cache, value_cache, head_size);
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(),
              "query and the caches must have the same dtype");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() &&
              out.scalar_type() == query.scalar_type(),
              "out must be a contiguous tensor shaped and typed like query");
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(3);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
              block_tables.is_contiguous() && block_tables.size(0) == num_seqs,
              "block_tables must be contiguous int32 [num_seqs, max_blocks_per_seq]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 &&
              context_lens.is_contiguous() && context_lens.size(0) == num_seqs,
              "context_lens must be contiguous int32 [num_seqs]");
  TORCH_CHECK(max_context_len >= 0, "max_context_len must be >= 0");
  const int dtype = dtype_code(query);

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int code = minipaged_paged_attention(
      out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
      block_tables.data_ptr<int>(), context_lens.data_ptr<int>(), (int)num_seqs, (int)num_heads,
      (int)num_kv_heads, (int)head_size, (int)block_size, (int)block_tables.size(1),
      query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), (float)scale,
      (int)max_context_len, dtype, stream);
  if (code == -4) {
    TORCH_CHECK(false, "minipaged paged_attention: max_context_len = ", max_context_len,
                " tokens need more shared memory for their logits than this GPU gives one block;"
                " the most it can take is about ",
                minipaged_paged_attention_max_context_len((int)head_size, dtype), " tokens");
  }
  check_code(code, "paged_attention");
}

// ---------------------------------------------------------------------------------------------
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor slot_mapping) {
  const auto device = key_cache.device();
  check_cuda(key, "key", device);
  check_cuda(value, "value", device);
  check_cuda(value_cache, "value_cache", device);
  check_cuda(slot_mapping, "slot_mapping", device);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "key and value must both be [num_tokens, num_kv_heads, head_size]");
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_size = key.size(2);
  for (const auto* t : {&key, &value}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == head_size,
                "each token's key and value must be contiguous (a row view is fine)");
  }
  check_caches(key_cache, value_cache, head_size);
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
              value.scalar_type() == key_cache.scalar_type(),
              "key, value and the caches must have the same dtype");
  TORCH_CHECK(key_cache.size(1) == num_kv_heads, "the caches hold ", key_cache.size(1),
              " kv heads, the keys ", num_kv_heads);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
              slot_mapping.is_contiguous() && slot_mapping.size(0) == num_tokens,
              "slot_mapping must be contiguous int64 [num_tokens]");

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  check_code(minipaged_reshape_and_cache(
                 key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                 slot_mapping.data_ptr<int64_t>(), (int)num_tokens, (int)num_kv_heads,
                 (int)head_size, (int)key_cache.size(3), (int)key_cache.size(4), key.stride(0),
                 value.stride(0), (int)key.element_size(), stream),
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
  auto pointers = torch::empty({2, num_layers}, torch::kLong);  // row 0 keys, row 1 values
  auto pointer_rows = pointers.accessor<int64_t, 2>();
  for (int64_t l = 0; l < num_layers; ++l) {
    const auto& k = key_caches[l];
    const auto& v = value_caches[l];
    check_cuda(k, "key_caches[l]", device);
    check_cuda(v, "value_caches[l]", device);
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "caches must be contiguous");
    TORCH_CHECK(k.sizes() == first.sizes() && v.sizes() == value_caches[0].sizes() &&
                k.scalar_type() == first.scalar_type() &&
                v.scalar_type() == value_caches[0].scalar_type(),
                "every layer's caches must have the same shape and dtype");
    pointer_rows[0][l] = reinterpret_cast<int64_t>(k.data_ptr());
    pointer_rows[1][l] = reinterpret_cast<int64_t>(v.data_ptr());
  }
  const auto pairs = block_pairs.contiguous();
  TORCH_CHECK(pairs.numel() == 0 || (pairs.min().item<int64_t>() >= 0 &&
                                     pairs.max().item<int64_t>() < num_blocks),
              "copy_blocks: block numbers must be in [0, ", num_blocks, ")");

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto pointers_gpu = pointers.to(device);
  const auto pairs_gpu = pairs.to(device);
  const int64_t key_block_bytes = first.numel() / num_blocks * first.element_size();
  const int64_t value_block_bytes =
      value_caches[0].numel() / num_blocks * value_caches[0].element_size();
  check_code(minipaged_copy_blocks(pointers_gpu[0].data_ptr<int64_t>(),
                                   pointers_gpu[1].data_ptr<int64_t>(),
                                   pairs_gpu.data_ptr<int64_t>(), (int)num_layers,
                                   (int)pairs.size(0), key_block_bytes, value_block_bytes,
                                   stream),
             "copy_blocks");
}

// ---------------------------------------------------------------------------------------------
// dst[d] = src[s] for each (s, d) row of block_pairs (int64 CPU [num_pairs, 2]); one of src and
// dst may be a CPU tensor (pin it for asynchronous copies).
void swap_blocks(torch::Tensor src, torch::Tensor dst, torch::Tensor block_pairs) {
  TORCH_CHECK(src.is_cuda() || dst.is_cuda(), "swap_blocks: src or dst must be on the GPU");
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
                "swap_blocks: block numbers out of range");
  }
  cudaMemcpyKind kind;
  if (src.is_cuda() && dst.is_cuda()) {
    kind = cudaMemcpyDeviceToDevice;
  } else if (src.is_cuda()) {
    kind = cudaMemcpyDeviceToHost;
  } else {
    kind = cudaMemcpyHostToDevice;
  }
  const auto device = src.is_cuda() ? src.device() : dst.device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int64_t block_bytes = src.size(0) == 0 ? 0 : src.numel() / src.size(0) * src.element_size();
  check_code(minipaged_swap_blocks(dst.data_ptr(), src.data_ptr(), block_bytes,
                                   pairs.data_ptr<int64_t>(), (int)pairs.size(0), (int)kind,
                                   stream),
             "swap_blocks");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "minipaged CUDA kernels (see csrc/). Use them through minipaged.cuda_ops.load().";
  m.def("paged_attention", &paged_attention,
        "paged_attention(out, query, key_cache, value_cache, block_tables, context_lens, scale, "
        "max_context_len): single-query attention through block tables, written into out");
  m.def("reshape_and_cache", &reshape_and_cache,
        "reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)");
  m.def("copy_blocks", &copy_blocks, "copy_blocks(key_caches, value_caches, block_pairs)");
  m.def("swap_blocks", &swap_blocks, "swap_blocks(src, dst, block_pairs)");
}
