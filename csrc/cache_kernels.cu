// The cache kernels: the only places where KV data moves (lessons 02-04 and 06).
//
//   reshape_and_cache  after the model computes a token's key and value, write them into the
//                      token's slot of the paged cache (one CUDA block per token).
//   copy_blocks        copy-on-write: copy whole physical blocks src -> dst in every layer
//                      (one CUDA block per (layer, pair)).
//   swap_blocks        preemption by swapping: move whole blocks between GPU memory and pinned
//                      CPU memory (one cudaMemcpyAsync per block).
//
// These kernels move bits and never do arithmetic on them, so they are templated on the size of
// an element (2 or 4 bytes), not on its type.
//
// Layouts (the same as in paged_attention.cu and minipaged/kernels/reference.py):
//   key          [num_tokens, num_kv_heads, head_size]   rows may be strided (a view of qkv)
//   value        [num_tokens, num_kv_heads, head_size]
//   key_cache    [num_blocks, num_kv_heads, head_size / X, block_size, X]   X = 16 / element size
//   value_cache  [num_blocks, num_kv_heads, head_size, block_size]
//   slot_mapping [num_tokens] int64: block * block_size + offset, negative = padding, skip

#include <cuda_runtime.h>
#include <cstdint>

#include "kernels.h"  // the extern "C" declarations: the compiler checks they match
#include "kv_quant.cuh"  // 8-bit codes (lesson 18)

namespace minipaged {

// ----------------------------------------------------------------------------------------------
// reshape_and_cache
// ----------------------------------------------------------------------------------------------
template <typename Word>  // uint16_t for fp16/bf16, uint32_t for fp32
__global__ void reshape_and_cache_kernel(
    const Word* __restrict__ key, const Word* __restrict__ value, Word* __restrict__ key_cache,
    Word* __restrict__ value_cache, const int64_t* __restrict__ slot_mapping,
    int64_t key_token_stride, int64_t value_token_stride, int num_kv_heads, int head_size,
    int block_size, int x) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // a padding token: it has no slot
  const int64_t block = slot / block_size;
  const int offset = (int)(slot % block_size);

  const int64_t cache_block_stride = (int64_t)num_kv_heads * head_size * block_size;
  const int per_token = num_kv_heads * head_size;
  // Thread i copies element i of the token's (num_kv_heads, head_size) key and value.
  for (int i = threadIdx.x; i < per_token; i += blockDim.x) {
    const int head = i / head_size;
    const int d = i % head_size;
    const int64_t head_base = block * cache_block_stride + (int64_t)head * head_size * block_size;
    // key_cache[block, head, d / x, offset, d % x]
    key_cache[head_base + ((int64_t)(d / x) * block_size + offset) * x + d % x] =
        key[token * key_token_stride + i];
    // value_cache[block, head, d, offset]
    value_cache[head_base + (int64_t)d * block_size + offset] =
        value[token * value_token_stride + i];
  }
}

// ----------------------------------------------------------------------------------------------
// copy_blocks
// ----------------------------------------------------------------------------------------------
// key_cache_ptrs[layer] and value_cache_ptrs[layer] are the layers' base addresses;
// block_pairs holds (src, dst) pairs flattened: [src0, dst0, src1, dst1, ...].
template <typename Word>  // uint4 when a block is a whole number of 16-byte words, else a byte
__global__ void copy_blocks_kernel(const int64_t* __restrict__ key_cache_ptrs,
                                   const int64_t* __restrict__ value_cache_ptrs,
                                   const int64_t* __restrict__ block_pairs,
                                   int64_t key_block_words, int64_t value_block_words) {
  const int layer = blockIdx.x;
  const int pair = blockIdx.y;
  const int64_t src = block_pairs[2 * pair];
  const int64_t dst = block_pairs[2 * pair + 1];
  Word* key_cache = reinterpret_cast<Word*>(key_cache_ptrs[layer]);
  Word* value_cache = reinterpret_cast<Word*>(value_cache_ptrs[layer]);
  for (int64_t i = threadIdx.x; i < key_block_words; i += blockDim.x) {
    key_cache[dst * key_block_words + i] = key_cache[src * key_block_words + i];
  }
  for (int64_t i = threadIdx.x; i < value_block_words; i += blockDim.x) {
    value_cache[dst * value_block_words + i] = value_cache[src * value_block_words + i];
  }
}

constexpr int MAX_GRID_Y = 65535;  // CUDA's limit on gridDim.y (and z)

// The launch error of *this* launch: an error left pending by an earlier call is cleared before
// launching (it was that call's to report), and each launch is checked right after.
inline void clear_stale_error() { (void)cudaGetLastError(); }
inline int launch_error() { return (int)cudaGetLastError(); }

// ----------------------------------------------------------------------------------------------
// reshape_and_cache into an 8-bit cache (lesson 18): this one does arithmetic. One CUDA block per
// token; one thread per (kv head, key or value) finds the vector's largest magnitude, then
// writes its scale and its codes (the same divisions as minipaged/kernels/kv_quant.py).
// ----------------------------------------------------------------------------------------------
template <typename T, typename C>
__global__ void reshape_and_cache_8bit_kernel(
    const T* __restrict__ key, const T* __restrict__ value, C* __restrict__ key_cache,
    C* __restrict__ value_cache, float* __restrict__ key_scales,
    float* __restrict__ value_scales, const int64_t* __restrict__ slot_mapping,
    int64_t key_token_stride, int64_t value_token_stride, int num_kv_heads, int head_size,
    int block_size) {
  constexpr int X = 16;  // one-byte codes in a 16-byte key chunk
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // a padding token: it has no slot
  const int64_t block = slot / block_size;
  const int offset = (int)(slot % block_size);
  for (int i = threadIdx.x; i < 2 * num_kv_heads; i += blockDim.x) {
    const int head = i / 2;
    const bool is_value = i % 2 == 1;
    const T* src = is_value ? value + token * value_token_stride + head * head_size
                            : key + token * key_token_stride + head * head_size;
    float amax = 0.f;
    for (int d = 0; d < head_size; ++d) amax = fmaxf(amax, fabsf(to_float(src[d])));
    const float s = code_scale<C>(amax);
    const int64_t head_block = block * num_kv_heads + head;  // [block, head] of the scales
    const int64_t head_base = head_block * head_size * block_size;
    for (int d = 0; d < head_size; ++d) {
      const C code = quantize_one<C>(to_float(src[d]), s);
      if (is_value) {
        value_cache[head_base + (int64_t)d * block_size + offset] = code;  // [d, offset]
      } else {  // [d / X, offset, d % X]
        key_cache[head_base + ((int64_t)(d / X) * block_size + offset) * X + d % X] = code;
      }
    }
    (is_value ? value_scales : key_scales)[head_block * block_size + offset] = s;
  }
}

template <typename T, typename C>
int launch_reshape_and_cache_8bit(const void* key, const void* value, void* key_cache,
                                  void* value_cache, float* key_scales, float* value_scales,
                                  const int64_t* slot_mapping, int num_tokens, int num_kv_heads,
                                  int head_size, int block_size, int64_t key_token_stride,
                                  int64_t value_token_stride, cudaStream_t stream) {
  const int threads = 2 * num_kv_heads < 128 ? 2 * num_kv_heads : 128;
  clear_stale_error();
  reshape_and_cache_8bit_kernel<T, C><<<dim3(num_tokens), threads, 0, stream>>>(
      static_cast<const T*>(key), static_cast<const T*>(value), static_cast<C*>(key_cache),
      static_cast<C*>(value_cache), key_scales, value_scales, slot_mapping, key_token_stride,
      value_token_stride, num_kv_heads, head_size, block_size);
  return launch_error();
}

}  // namespace minipaged

// key, value: dtype 0 = float32, 1 = float16, 2 = bfloat16 (each head's row contiguous); the
// caches hold cache_dtype 3 = int8 or 4 = fp8 e4m3 codes, contiguous, with key_scales and
// value_scales [num_blocks, num_kv_heads, block_size]. Negative slots are skipped.
extern "C" int minipaged_reshape_and_cache_8bit(const void* key, const void* value,
                                                void* key_cache, void* value_cache,
                                                float* key_scales, float* value_scales,
                                                const int64_t* slot_mapping, int num_tokens,
                                                int num_kv_heads, int head_size, int block_size,
                                                int64_t key_token_stride,
                                                int64_t value_token_stride, int dtype,
                                                int cache_dtype, cudaStream_t stream) {
  if (num_tokens == 0 || num_kv_heads == 0) return 0;
  auto run = [&](auto type, auto code) {
    using T = decltype(type);
    using C = decltype(code);
    return minipaged::launch_reshape_and_cache_8bit<T, C>(
        key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping, num_tokens,
        num_kv_heads, head_size, block_size, key_token_stride, value_token_stride, stream);
  };
  auto with_code = [&](auto type) {
    switch (cache_dtype) {
      case 3: return run(type, int8_t{});
      case 4: return run(type, minipaged::fp8_e4m3{});
      default: return -1;
    }
  };
  switch (dtype) {
    case 0: return with_code(float{});
    case 1: return with_code(__half{});
    case 2: return with_code(__nv_bfloat16{});
    default: return -1;
  }
}

// All launchers return 0 on success, a cudaError_t (> 0) on a CUDA error, or -1 for an element
// size they do not handle.

extern "C" int minipaged_reshape_and_cache(
    const void* key, const void* value, void* key_cache, void* value_cache,
    const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_size, int block_size,
    int x, int64_t key_token_stride, int64_t value_token_stride, int element_size,
    cudaStream_t stream) {
  const int per_token = num_kv_heads * head_size;
  if (num_tokens == 0 || per_token == 0) return 0;
  const int threads = per_token < 512 ? per_token : 512;
  const dim3 grid(num_tokens);  // gridDim.x: up to 2^31 - 1 tokens
  minipaged::clear_stale_error();
  if (element_size == 2) {
    minipaged::reshape_and_cache_kernel<uint16_t><<<grid, threads, 0, stream>>>(
        static_cast<const uint16_t*>(key), static_cast<const uint16_t*>(value),
        static_cast<uint16_t*>(key_cache), static_cast<uint16_t*>(value_cache), slot_mapping,
        key_token_stride, value_token_stride, num_kv_heads, head_size, block_size, x);
  } else if (element_size == 4) {
    minipaged::reshape_and_cache_kernel<uint32_t><<<grid, threads, 0, stream>>>(
        static_cast<const uint32_t*>(key), static_cast<const uint32_t*>(value),
        static_cast<uint32_t*>(key_cache), static_cast<uint32_t*>(value_cache), slot_mapping,
        key_token_stride, value_token_stride, num_kv_heads, head_size, block_size, x);
  } else {
    return -1;
  }
  return minipaged::launch_error();
}

// key_cache_ptrs, value_cache_ptrs ([num_layers]) and block_pairs ([2 * num_pairs]) are device
// arrays. Every layer's caches must be at least 16-byte aligned (torch allocations are).
// The pairs sit on gridDim.y, which CUDA caps at 65535: more pairs are copied by several
// launches of at most 65535 pairs each (a fork of a long prompt into many beams can get there).
extern "C" int minipaged_copy_blocks(const int64_t* key_cache_ptrs,
                                     const int64_t* value_cache_ptrs,
                                     const int64_t* block_pairs, int num_layers, int num_pairs,
                                     int64_t key_block_bytes, int64_t value_block_bytes,
                                     cudaStream_t stream) {
  if (num_layers <= 0 || num_pairs <= 0) return 0;
  const bool vectors = key_block_bytes % 16 == 0 && value_block_bytes % 16 == 0;
  // One thread per word of the larger block, in whole warps, at most 256 (a real cache block of
  // one layer is kilobytes: 256 threads; a toy one needs no more than a warp).
  const int64_t largest = key_block_bytes > value_block_bytes ? key_block_bytes
                                                              : value_block_bytes;
  const int64_t words = vectors ? largest / 16 : largest;
  const int threads = words >= 256 ? 256 : words <= 32 ? 32 : (int)((words + 31) / 32 * 32);
  minipaged::clear_stale_error();
  for (int first = 0; first < num_pairs; first += minipaged::MAX_GRID_Y) {
    const int count = num_pairs - first < minipaged::MAX_GRID_Y ? num_pairs - first
                                                                : minipaged::MAX_GRID_Y;
    const dim3 grid(num_layers, count);
    const int64_t* pairs = block_pairs + 2 * (int64_t)first;
    if (vectors) {
      minipaged::copy_blocks_kernel<uint4><<<grid, threads, 0, stream>>>(
          key_cache_ptrs, value_cache_ptrs, pairs, key_block_bytes / 16, value_block_bytes / 16);
    } else {
      minipaged::copy_blocks_kernel<unsigned char><<<grid, threads, 0, stream>>>(
          key_cache_ptrs, value_cache_ptrs, pairs, key_block_bytes, value_block_bytes);
    }
    const int err = minipaged::launch_error();
    if (err) return err;
  }
  return 0;
}

// block_pairs ([2 * num_pairs], host memory): dst block pairs[2i+1] <- src block pairs[2i].
// kind is a cudaMemcpyKind (host-to-device, device-to-host or device-to-device). The copies are
// queued on `stream`; with pinned CPU memory they do not block the host, so the caller must
// synchronise the stream before it reads the CPU side. (No kernel launch: each copy returns its
// own error, so a stale error of an earlier call cannot be mistaken for one of these.)
extern "C" int minipaged_swap_blocks(void* dst, const void* src, int64_t block_bytes,
                                     const int64_t* block_pairs, int num_pairs, int kind,
                                     cudaStream_t stream) {
  char* dst_bytes = static_cast<char*>(dst);
  const char* src_bytes = static_cast<const char*>(src);
  for (int i = 0; i < num_pairs; ++i) {
    const int64_t s = block_pairs[2 * i];
    const int64_t d = block_pairs[2 * i + 1];
    const cudaError_t err =
        cudaMemcpyAsync(dst_bytes + d * block_bytes, src_bytes + s * block_bytes, block_bytes,
                        static_cast<cudaMemcpyKind>(kind), stream);
    if (err != cudaSuccess) return (int)err;
  }
  return 0;
}
