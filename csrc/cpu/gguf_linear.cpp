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
// The codes become 8-float vectors (`v8`, vec8.h), the sums run over 8 lanes, and d multiplies
// a whole block's partial sums at once. Q4_1's m multiplies the sum of the block's 32 inputs:
// those sums are made once per input row before the weight rows are read (`block_sums`), not
// once per weight row (a decode step's x meets every weight row of the layer). The result equals the dequantized weights
// times x up to float rounding (the sum is in another order): tests/models/test_gguf_linear.py.
//
// Each output row (weight row n, input row j) is computed by one thread in one fixed order, so a
// row's result does not depend on the batch or the threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "linear_tile.h"
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

// NOTE: each 8 bytes widened to 8 ints first (one instruction, reading memory), then split in
// the ints' lanes: a byte's high nibble is the int shifted right by 4, no mask needed. Splitting
// the 16 bytes before widening took 4 instructions more a block, and the loop is bound by its
// instructions, not by the bytes it reads (4.7 GB/s of blocks on one Zen 3 core).
inline void q4_1_codes(const uint8_t* block, v8 q[4]) {
  const __m256i first = _mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 4)));   // bytes 0-7
  const __m256i second = _mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 12)));  // bytes 8-15
  const __m256i low = _mm256_set1_epi32(0x0F);
  q[0] = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(first, low));   // codes 0-7
  q[1] = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(second, low));  // codes 8-15
  q[2] = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));    // codes 16-23
  q[3] = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));   // codes 24-31
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

// The sum of each block's 32 inputs, for each of M input rows: sums[j * num_blocks + b] (the
// Q4_1 blocks' m multiplies it). In one fixed order, so every weight row gets the same sums.
void block_sums(const float* x, int64_t x_stride, int64_t M, int64_t num_blocks, float* sums) {
  for (int64_t j = 0; j < M; ++j)
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* xb = x + j * x_stride + b * kBlock;
      sums[j * num_blocks + b] = sum8((load8(xb) + load8(xb + 8)) +
                                      (load8(xb + 16) + load8(xb + 24)));
    }
}

// Block b's share of one input row: d * (its codes . x) into one of two accumulators (blocks
// even and odd: two chains of fused multiply-adds in flight, not one), and m * (x's block sum).
template <int64_t FORMAT>
inline void add_block(const v8 q[4], v8 d, float m, const float* xb, float x_sum, v8& acc,
                      float& m_acc) {
  const v8 dot = fma8(q[1], load8(xb + 8), q[0] * load8(xb)) +
                 fma8(q[3], load8(xb + 24), q[2] * load8(xb + 16));
  acc = fma8(d, dot, acc);
  if (FORMAT == kQ4_1) m_acc = fma1(m, x_sum, m_acc);
}

template <int64_t FORMAT>
inline void block_codes(const uint8_t* block, v8 q[4]) {
  if (FORMAT == kQ8_0) q8_0_codes(block, q);
  else if (FORMAT == kQ5_0) q5_0_codes(block, q);
  else q4_1_codes(block, q);
}

// One weight row (its blocks) against R input rows: y[j * y_stride] for j < R. `sums` holds
// the R rows' block sums (`block_sums`, Q4_1 only), num_blocks apart.
template <int64_t FORMAT, int R>
void row_times_inputs(const uint8_t* w, int64_t num_blocks, const float* x, int64_t x_stride,
                      const float* sums, float* y, int64_t y_stride) {
  constexpr int64_t bytes = block_bytes(FORMAT);
  v8 even[R], odd[R];
  float m_even[R], m_odd[R];
  for (int j = 0; j < R; ++j) {
    even[j] = odd[j] = v8{};
    m_even[j] = m_odd[j] = 0.f;
  }
  // blocks two at a time (even, odd), then the last one if their number is odd
  auto block_at = [&](int64_t b, v8* acc, float* m_acc) {
    const uint8_t* block = w + b * bytes;
    v8 q[4];
    block_codes<FORMAT>(block, q);
    float d, m = 0.f;
    if (FORMAT == kQ4_1) half_pair_at(block, d, m);
    else d = half_at(block);
    const v8 dv = splat8(d);
    for (int j = 0; j < R; ++j) {
      const float x_sum = FORMAT == kQ4_1 ? sums[j * num_blocks + b] : 0.f;
      add_block<FORMAT>(q, dv, m, x + j * x_stride + b * kBlock, x_sum, acc[j], m_acc[j]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= num_blocks; b += 2) {
    block_at(b, even, m_even);
    block_at(b + 1, odd, m_odd);
  }
  if (b < num_blocks) block_at(b, even, m_even);
  for (int j = 0; j < R; ++j) y[j * y_stride] = sum8(even[j] + odd[j]) + (m_even[j] + m_odd[j]);
}

template <int64_t FORMAT>
void all_rows(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const float* x,
              int64_t x_stride, int64_t M, float* y, int64_t N) {
  std::vector<float> sums(FORMAT == kQ4_1 ? M * num_blocks : 0);
  if (FORMAT == kQ4_1) block_sums(x, x_stride, M, num_blocks, sums.data());
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = w + n * row_bytes;
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows)
        row_times_inputs<FORMAT, kRows>(row, num_blocks, x + m * x_stride, x_stride,
                                        sums.data() + m * num_blocks, y + m * N + n, N);
      for (; m < M; ++m)
        row_times_inputs<FORMAT, 1>(row, num_blocks, x + m * x_stride, x_stride,
                                    sums.data() + m * num_blocks, y + m * N + n, N);
    }
  });
}

}  // namespace

// The arguments of gguf_linear and gguf_linear_tiled, checked before any loop runs; `op` names
// the function in the messages.
static void check_linear_args(const char* op, const at::Tensor& x, const at::Tensor& blocks,
                       int64_t format) {
  TORCH_CHECK(format == kQ4_1 || format == kQ5_0 || format == kQ8_0, op, ": block format ",
              format, " is not one this op reads (Q4_1 = 3, Q5_0 = 6, Q8_0 = 8)");
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2, op, ": x must be (rows, in) and blocks "
              "(out, bytes per row), got x of ", x.sizes(), " and blocks of ", blocks.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(blocks.scalar_type() == at::kByte, op, ": blocks must be uint8, got ",
              blocks.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, op, ": x's rows must be contiguous");
  TORCH_CHECK(blocks.is_contiguous(), op, ": blocks must be contiguous");
  const int64_t K = x.size(1), bytes = block_bytes(format);
  TORCH_CHECK(K % kBlock == 0, op, ": x's features (", K, ") must be a multiple of ", kBlock);
  TORCH_CHECK(blocks.size(1) == K / kBlock * bytes, op, ": ", K, " features need ",
              K / kBlock * bytes, " bytes of blocks per row, got ", blocks.size(1));
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format) {
  check_linear_args("gguf_linear", x, blocks, format);
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
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

// A matrix of blocks as float32 (N, K): the weights transformers' GGUF loader gives, bit for bit
// (Q4_1: d * q + m, d * q exact in float32 and rounded once with m; Q8_0: d * q; Q5_0:
// d * (q - 16): both exact). For a step of many rows, where BLAS on a float tile outruns the
// loop above (models/gguf_linear.py measures which).
namespace {
// Rows [0, count) of blocks as float32, K = num_blocks * 32 floats each, into out.
template <int64_t FORMAT>
void dequantize_rows_into(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, int64_t count,
                          float* out) {
  constexpr int64_t bytes = block_bytes(FORMAT);
  const int64_t K = num_blocks * kBlock;
  for (int64_t n = 0; n < count; ++n)
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block = w + n * row_bytes + b * bytes;
      v8 q[4];
      block_codes<FORMAT>(block, q);
      float d, m = 0.f;
      if (FORMAT == kQ4_1) half_pair_at(block, d, m);
      else d = half_at(block);
      const v8 dv = splat8(d), mv = splat8(m);
      float* o = out + n * K + b * kBlock;
      for (int c = 0; c < 4; ++c) {
        const v8 v = FORMAT == kQ4_1 ? fma8(dv, q[c], mv) : dv * q[c];
        std::memcpy(o + 8 * c, &v, sizeof(v));
      }
    }
}

template <int64_t FORMAT>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, int64_t N,
                     float* out) {
  const int64_t K = num_blocks * kBlock;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    dequantize_rows_into<FORMAT>(w + begin * row_bytes, row_bytes, num_blocks, end - begin,
                                 out + begin * K);
  });
}
}  // namespace

// y = x W^T for a batch of rows: every NB weight rows dequantized into a small buffer (it stays
// in the L1 cache), then the few-row float32 loop of linear.cpp on them. The weights are read as
// blocks (a fifth of float32's bytes for Q4_1) and decoded once per batch, not once per 4 rows
// as in `all_rows`. (A row's result then is linear.cpp's order, not `all_rows`': each routine
// gives every row of a batch the same result, whatever its other rows.)
namespace {
template <int64_t FORMAT>
void all_rows_tiled(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const float* x,
                    int64_t x_stride, int64_t M, float* y, int64_t N) {
  const int64_t K = num_blocks * kBlock;
  const int64_t num_tiles = (N + NB - 1) / NB;
  at::parallel_for(0, num_tiles, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(NB * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * NB, count = std::min<int64_t>(NB, N - n);
      dequantize_rows_into<FORMAT>(w + n * row_bytes, row_bytes, num_blocks, count, rows.data());
      // linear_rows reads weight row n + i at w + (n + i) * K: the buffer's row i
      const float* base = rows.data() - n * K;
      if (count == NB) linear_rows<NB>(x, x_stride, M, base, K, y, N, n);
      else
        for (int64_t r = n; r < n + count; ++r) linear_rows<1>(x, x_stride, M, base, K, y, N, r);
    }
  });
}
}  // namespace

at::Tensor gguf_linear_tiled(const at::Tensor& x, const at::Tensor& blocks, int64_t format) {
  check_linear_args("gguf_linear_tiled", x, blocks, format);
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (format == kQ8_0)
    all_rows_tiled<kQ8_0>(wp, blocks.size(1), K / kBlock, xp, x.stride(0), M, yp, N);
  else if (format == kQ5_0)
    all_rows_tiled<kQ5_0>(wp, blocks.size(1), K / kBlock, xp, x.stride(0), M, yp, N);
  else
    all_rows_tiled<kQ4_1>(wp, blocks.size(1), K / kBlock, xp, x.stride(0), M, yp, N);
  return y;
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t format) {
  TORCH_CHECK(format == kQ4_1 || format == kQ5_0 || format == kQ8_0, "gguf_dequantize: block "
              "format ", format, " is not one this op reads (Q4_1 = 3, Q5_0 = 6, Q8_0 = 8)");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
              blocks.device().is_cpu(), "gguf_dequantize: blocks must be a contiguous uint8 CPU "
              "tensor (out, bytes per row), got ", blocks.scalar_type(), " ", blocks.sizes());
  const int64_t bytes = block_bytes(format);
  TORCH_CHECK(blocks.size(1) % bytes == 0, "gguf_dequantize: a row of ", blocks.size(1),
              " bytes is not a whole number of ", bytes, "-byte blocks");
  const int64_t N = blocks.size(0), num_blocks = blocks.size(1) / bytes;
  at::Tensor out = at::empty({N, num_blocks * kBlock}, blocks.options().dtype(at::kFloat));
  if (N == 0 || num_blocks == 0) return out;
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (format == kQ8_0) dequantize_rows<kQ8_0>(wp, blocks.size(1), num_blocks, N, op);
  else if (format == kQ5_0) dequantize_rows<kQ5_0>(wp, blocks.size(1), num_blocks, N, op);
  else dequantize_rows<kQ4_1>(wp, blocks.size(1), num_blocks, N, op);
  return out;
}

}  // namespace minipaged_cpu
