// y = x W^T with W kept as a GGUF file stores it: blocks of 32 weights, dequantized inside the dot
// product (issue 58; minipaged/models/gguf_linear.py chooses this routine per shape).
//
// Decode reads every weight once per step, so its time is the weights' bytes over the memory's
// bandwidth. A float32 weight is 4 bytes; a Q8_0 block holds 32 weights in 34 bytes, a Q4_1 block
// in 20. Reading the blocks and turning each into floats in registers, next to the products that
// use them, reads 4-6x fewer bytes than a float32 copy of the same weights.
//
//   Q8_0 block (34 bytes): d (float16), then 32 int8 codes q;   w_i = d * q_i
//   Q4_1 block (20 bytes): d, m (float16), then 16 bytes: byte j's low 4 bits are code j,
//                          its high 4 bits code j + 16;          w_i = d * q_i + m
//   Q5_0 block (22 bytes): d (float16), a 32-bit word whose bit i is code i's fifth bit, then
//                          16 bytes of low 4 bits as Q4_1's;    w_i = d * (q_i - 16)
//
// So a block's share of a dot product with x is
//   Q8_0, Q5_0:  d * sum_i q_i x_i   (Q5_0's q_i less 16)
//   Q4_1:        d * sum_i q_i x_i + m * sum_i x_i
// The codes become 8-float vectors (`v8`, vec8.h), the sums run over 8 lanes, and d (and
// m) multiply a whole block's partial sums at once. The result equals the dequantized weights
// times x up to float rounding (the sum is in another order): tests/models/test_gguf_linear.py.
//
// Each output row (weight row n, input row j) is computed by one thread in one fixed order, so a
// row's result does not depend on the batch or the threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "vec8.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace minipaged_cpu {
namespace {

typedef int8_t s8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));

constexpr int64_t kBlock = 32;      // weights per block (every format here)
constexpr int64_t kQ4_1 = 3;        // ggml's numbers for the formats
constexpr int64_t kQ5_0 = 6;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kQ4_1Bytes = 20;
constexpr int64_t kQ5_0Bytes = 22;
constexpr int64_t kQ8_0Bytes = 34;

constexpr int64_t block_bytes(int64_t format) {
  return format == kQ8_0 ? kQ8_0Bytes : format == kQ5_0 ? kQ5_0Bytes : kQ4_1Bytes;
}
constexpr int kRows = 4;  // input rows that share each block's codes once they are floats

// The 32 codes of a block as 4 vectors of 8 floats, in the weights' order.
// NOTE: with AVX2 written as its instructions (widen 8 bytes to 8 ints, convert): GCC's generic
// 8-byte vectors were converted one lane at a time, and the loop ran slower than float32's.
#if defined(__AVX2__)
inline v8 bytes_to_floats(__m128i eight, bool is_signed) {
  const __m256i ints = is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
  return (v8)_mm256_cvtepi32_ps(ints);
}

inline void q8_0_codes(const uint8_t* block, v8 q[4]) {
  for (int c = 0; c < 4; ++c)
    q[c] = bytes_to_floats(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * c)),
                           true);
}

inline void q4_1_codes(const uint8_t* block, v8 q[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);                     // codes 0-15
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);  // codes 16-31
  q[0] = bytes_to_floats(lo, false);
  q[1] = bytes_to_floats(_mm_srli_si128(lo, 8), false);
  q[2] = bytes_to_floats(hi, false);
  q[3] = bytes_to_floats(_mm_srli_si128(hi, 8), false);
}
#else
inline void q8_0_codes(const uint8_t* block, v8 q[4]) {
  for (int c = 0; c < 4; ++c) {
    s8x8 raw;
    std::memcpy(&raw, block + 2 + 8 * c, 8);
    q[c] = __builtin_convertvector(raw, v8);
  }
}

inline void q4_1_codes(const uint8_t* block, v8 q[4]) {
  u8x8 lo, hi;
  std::memcpy(&lo, block + 4, 8);   // bytes 0-7: codes 0-7 (low bits), 16-23 (high bits)
  std::memcpy(&hi, block + 12, 8);  // bytes 8-15: codes 8-15, 24-31
  const u8x8 mask = {15, 15, 15, 15, 15, 15, 15, 15};
  q[0] = __builtin_convertvector(lo & mask, v8);
  q[1] = __builtin_convertvector(hi & mask, v8);
  q[2] = __builtin_convertvector(lo >> 4, v8);
  q[3] = __builtin_convertvector(hi >> 4, v8);
}
#endif

// Q5_0's 32 codes (less 16) as 4 vectors of 8 floats: a code is its nibble (weight i < 16 in the
// low half of byte i, weight i + 16 in its high half) with bit i of the 32-bit word at byte 2 as
// its fifth bit.
#if defined(__AVX2__)
// NOTE: in vectors, not byte by byte: the loop over the 32 codes' bits ran at 0.5 GB/s of blocks,
// a Q5_0 matmul 13x slower than float32's, and Gemma 3's GGUF decode slower than its float32.
inline void q5_0_codes(const uint8_t* block, v8 q[4]) {
  uint32_t high;
  std::memcpy(&high, block + 2, 4);
  // byte j of the word (j = 0..31) takes byte j / 8 of `high`; it is all ones where the byte
  // has bit j % 8 set once the other seven bits are set too
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(high)),
      _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL,
                         0x0303030303030303LL));
  const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL);  // all bits but j % 8
  const __m256i is_set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others),
                                           _mm256_set1_epi8(-1));
  const __m256i fifth = _mm256_and_si256(is_set, _mm256_set1_epi8(0x10));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 6));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(raw, nibble);                      // weights 0..15
  const __m128i high4 = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);  // weights 16..31
  const __m256i codes = _mm256_or_si256(_mm256_set_m128i(high4, low), fifth);
  const __m128i first = _mm256_castsi256_si128(codes), second = _mm256_extracti128_si256(codes, 1);
  const v8 sixteen = splat8(16.f);
  q[0] = bytes_to_floats(first, false) - sixteen;
  q[1] = bytes_to_floats(_mm_srli_si128(first, 8), false) - sixteen;
  q[2] = bytes_to_floats(second, false) - sixteen;
  q[3] = bytes_to_floats(_mm_srli_si128(second, 8), false) - sixteen;
}
#else
inline void q5_0_codes(const uint8_t* block, v8 q[4]) {
  uint32_t high;
  std::memcpy(&high, block + 2, 4);
  uint8_t codes[kBlock];
  for (int i = 0; i < 16; ++i) {
    codes[i] = (block[6 + i] & 0x0F) | (((high >> i) & 1u) << 4);
    codes[i + 16] = (block[6 + i] >> 4) | (((high >> (i + 16)) & 1u) << 4);
  }
  const v8 sixteen = splat8(16.f);
  for (int c = 0; c < 4; ++c) {
    u8x8 raw;
    std::memcpy(&raw, codes + 8 * c, 8);
    q[c] = __builtin_convertvector(raw, v8) - sixteen;
  }
}
#endif

// One weight row (its blocks) against R input rows: y[j * y_stride] for j < R.
template <int64_t FORMAT, int R>
void row_times_inputs(const uint8_t* w, int64_t num_blocks, const float* x, int64_t x_stride,
                      float* y, int64_t y_stride) {
  constexpr int64_t bytes = block_bytes(FORMAT);
  v8 scaled[R], mins[R];
  for (int j = 0; j < R; ++j) scaled[j] = mins[j] = v8{};
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = w + b * bytes;
    v8 q[4];
    if (FORMAT == kQ8_0) q8_0_codes(block, q);
    else if (FORMAT == kQ5_0) q5_0_codes(block, q);
    else q4_1_codes(block, q);
    const v8 d = splat8(half_at(block));
    for (int j = 0; j < R; ++j) {
      const float* xb = x + j * x_stride + b * kBlock;
      const v8 x0 = load8(xb), x1 = load8(xb + 8), x2 = load8(xb + 16),
               x3 = load8(xb + 24);
      // (fused multiply-adds written out: the compiler may not fuse one instance and not another)
      const v8 dot = fma8(q[3], x3, fma8(q[2], x2, fma8(q[1], x1, q[0] * x0)));
      scaled[j] = fma8(d, dot, scaled[j]);
      if (FORMAT == kQ4_1)
        mins[j] = fma8(splat8(half_at(block + 2)), (x0 + x1) + (x2 + x3), mins[j]);
    }
  }
  for (int j = 0; j < R; ++j) y[j * y_stride] = sum8(scaled[j]) + sum8(mins[j]);
}

template <int64_t FORMAT>
void all_rows(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const float* x,
              int64_t x_stride, int64_t M, float* y, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = w + n * row_bytes;
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows)
        row_times_inputs<FORMAT, kRows>(row, num_blocks, x + m * x_stride, x_stride,
                                        y + m * N + n, N);
      for (; m < M; ++m)
        row_times_inputs<FORMAT, 1>(row, num_blocks, x + m * x_stride, x_stride, y + m * N + n,
                                    N);
    }
  });
}

}  // namespace

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format) {
  TORCH_CHECK(format == kQ4_1 || format == kQ5_0 || format == kQ8_0, "gguf_linear: block format ",
              format, " is not one this op reads (Q4_1 = 3, Q5_0 = 6, Q8_0 = 8)");
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2, "gguf_linear: x must be (rows, in) and blocks "
              "(out, bytes per row), got x of ", x.sizes(), " and blocks of ", blocks.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf_linear: x must be float32, got ",
              x.scalar_type());
  TORCH_CHECK(blocks.scalar_type() == at::kByte, "gguf_linear: blocks must be uint8, got ",
              blocks.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "gguf_linear: CPU tensors only");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "gguf_linear: x's rows must be contiguous");
  TORCH_CHECK(blocks.is_contiguous(), "gguf_linear: blocks must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  const int64_t bytes = block_bytes(format);
  TORCH_CHECK(K % kBlock == 0, "gguf_linear: x's features (", K, ") must be a multiple of ",
              kBlock);
  TORCH_CHECK(blocks.size(1) == K / kBlock * bytes, "gguf_linear: ", K, " features need ",
              K / kBlock * bytes, " bytes of blocks per row, got ", blocks.size(1));
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (format == kQ8_0)
    all_rows<kQ8_0>(wp, blocks.size(1), K / kBlock, xp, x.stride(0), M, yp, N);
  else if (format == kQ5_0)
    all_rows<kQ5_0>(wp, blocks.size(1), K / kBlock, xp, x.stride(0), M, yp, N);
  else
    all_rows<kQ4_1>(wp, blocks.size(1), K / kBlock, xp, x.stride(0), M, yp, N);
  return y;
}

}  // namespace minipaged_cpu
