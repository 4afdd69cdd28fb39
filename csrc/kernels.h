// The plain C interface of the kernels in csrc/*.cu: what a caller (torch_bindings.cpp, the
// sanitizer program csrc/cuda_on_cpu/sanitize_main.cpp) links against. Every function returns 0 on
// success, a cudaError_t (> 0) or one of the negative codes listed in paged_attention.cu
// (minipaged::ErrorCode). Pointers are device pointers unless a comment says otherwise.
// window (the paged attentions): a sliding window's tokens, the newest token sees positions
// context_len - window .. context_len - 1 and no block before them is read; 0 = the whole context.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

extern "C" {
int minipaged_paged_attention_plan(int num_seqs, int num_heads, int num_kv_heads, int head_size,
                                   int max_context_len, int cache_dtype, int version,
                                   int* chosen_version, int* partition_size,
                                   int64_t* workspace_bytes);
int minipaged_force_partition_size(int tokens);
int minipaged_set_v2_reduce(int mode);  // 0 = a reduce kernel (default), 1 = fused
int minipaged_paged_attention(void* out, const void* query, const void* key_cache,
                              const void* value_cache, const int* block_tables,
                              const int* context_lens, int num_seqs, int num_heads,
                              int num_kv_heads, int head_size, int block_size,
                              int max_blocks_per_seq, int64_t q_seq_stride, int64_t q_head_stride,
                              int64_t k_block_stride, int64_t k_head_stride,
                              int64_t v_block_stride, int64_t v_head_stride, float scale,
                              int max_context_len, int window, int dtype, int version,
                              void* workspace, int64_t workspace_bytes, cudaStream_t stream);
int minipaged_paged_attention_8bit(void* out, const void* query, const void* key_cache,
                                   const void* value_cache, const float* key_scales,
                                   const float* value_scales, const int* block_tables,
                                   const int* context_lens, int num_seqs, int num_heads,
                                   int num_kv_heads, int head_size, int block_size,
                                   int max_blocks_per_seq, int64_t q_seq_stride,
                                   int64_t q_head_stride, int64_t k_block_stride,
                                   int64_t k_head_stride, int64_t v_block_stride,
                                   int64_t v_head_stride, float scale, int max_context_len,
                                   int window, int dtype, int cache_dtype, int version,
                                   void* workspace, int64_t workspace_bytes, cudaStream_t stream);
// layer_kernels.cu: the small operations between a LLaMA layer's matmuls (dtype as above).
int minipaged_rms_norm(void* out, const void* input, const void* residual, void* sum_out,
                       const void* weight, float eps, int num_tokens, int hidden,
                       int64_t out_stride, int64_t input_stride, int64_t residual_stride,
                       int64_t sum_stride, int dtype, cudaStream_t stream);
int minipaged_rotary(void* q_out, void* k_out, const void* q, const void* k,
                     const int64_t* positions, const void* cos, const void* sin, int num_tokens,
                     int num_heads, int num_kv_heads, int head_size, int64_t q_stride,
                     int64_t k_stride, int64_t q_out_stride, int64_t k_out_stride, int dtype,
                     cudaStream_t stream);
int minipaged_silu_and_mul(void* out, const void* gate, const void* up, int64_t rows,
                           int64_t cols, int64_t gate_stride, int64_t up_stride, int dtype,
                           cudaStream_t stream);
int minipaged_paged_attention_v1_limits(int head_size, int block_size, int dtype,
                                        int64_t* static_bytes, int64_t* max_context_len);
int minipaged_reshape_and_cache(const void* key, const void* value, void* key_cache,
                                void* value_cache, const int64_t* slot_mapping, int num_tokens,
                                int num_kv_heads, int head_size, int block_size, int x,
                                int64_t key_token_stride, int64_t value_token_stride,
                                int element_size, cudaStream_t stream);
int minipaged_reshape_and_cache_8bit(const void* key, const void* value, void* key_cache,
                                     void* value_cache, float* key_scales, float* value_scales,
                                     const int64_t* slot_mapping, int num_tokens,
                                     int num_kv_heads, int head_size, int block_size,
                                     int64_t key_token_stride, int64_t value_token_stride,
                                     int dtype, int cache_dtype, cudaStream_t stream);
// gguf_matmul.cu: out [rows, out_features] = x [rows, in_features] W^T, W as rows of GGUF blocks
// (ggml_type: 8 = Q8_0, 3 = Q4_1, 6 = Q5_0, 12 = Q4_K, 14 = Q6_K); x rows x_stride apart, out
// contiguous, dtype as above. -14: another ggml_type; -15: in_features is not a whole number of
// blocks.
int minipaged_gguf_linear(void* out, const void* x, const void* weight, int ggml_type, int rows,
                          int out_features, int in_features, int64_t x_stride, int dtype,
                          cudaStream_t stream);
int minipaged_copy_blocks(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                          const int64_t* block_pairs, int num_layers, int num_pairs,
                          int64_t key_block_bytes, int64_t value_block_bytes,
                          cudaStream_t stream);
int minipaged_swap_blocks(void* dst, const void* src, int64_t block_bytes,
                          const int64_t* block_pairs, int num_pairs, int kind,
                          cudaStream_t stream);
}
