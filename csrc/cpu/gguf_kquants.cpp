// y = x W^T with W kept as GGUF's "K" blocks of 256 weights, Q4_K and Q6_K, dequantized inside the
// dot product (issue 58; gguf_linear.cpp does the same for the 32-weight formats, and
// minipaged/models/gguf_linear.py chooses the routine per shape).
//
//   Q4_K block (144 bytes): d, dmin (float16), 12 bytes of 8 scales sc and 8 mins mn (6 bits
//     each), then 128 bytes of codes: the 32 bytes of group g hold sub-block 2g in their low 4
//     bits and sub-block 2g + 1 in their high 4 bits (32 weights each).
//       w_i = (d * sc_s) * q_i - (dmin * mn_s)            for weight i of sub-block s
//   Q6_K block (210 bytes): 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales,
//     then d (float16). Each half of 128 weights has 64 bytes of low bits and 32 of high bits; its
//     group g of 32 weights takes the low (g = 0, 1) or high (g = 2, 3) nibbles of low-bit bytes
//     32 (g % 2) to 32 (g % 2) + 31, and bits 2g, 2g + 1 of the 32 high-bit bytes.
//       w_i = (d * sc_s) * (q_i - 32)                      for weight i of sub-block s (16 each)
//
// A sub-block's share of a dot product with x is then
//   Q4_K:  (d * sc_s) * sum_i q_i x_i - (dmin * mn_s) * sum_i x_i
//   Q6_K:  (d * sc_s) * sum_i (q_i - 32) x_i
// The sums of x over each 32 inputs do not depend on the weight row: they are added once per call,
// before the rows. The two scale products are rounded to float32 first, as in the `gguf` package's
// dequantization, so a one-hot x gives back a weight bit for bit
// (tests/kernels/test_gguf_kquants.py); any other x agrees with the dequantized matmul up to float
// rounding (the sums run in another order).
//
// The vector path (AVX2: 32 bytes of codes at a time) is compiled where torch found AVX2 or more
// on this CPU (minipaged/kernels/build.py picks the flags at run time); elsewhere the codes are
// unpacked one byte at a time. Each output (weight row n, input row j) is computed by one thread in
// one fixed order, so a row's result depends neither on the batch nor on the threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "vec8.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace minipaged_cpu {
namespace {

constexpr int64_t kQ4_K = 12;  // ggml's numbers for the formats
constexpr int64_t kQ6_K = 14;
constexpr int64_t kSuper = 256;  // weights per block
constexpr int64_t kGroup = 32;   // weights whose codes are unpacked at once
constexpr int kRows = 4;         // input rows that share each group's codes once they are floats

constexpr int64_t kbytes(int64_t format) { return format == kQ4_K ? 144 : 210; }

// 32 codes as 4 vectors of 8 floats. AVX2: the codes are 32 bytes in one register; generic: an
// array of 32 bytes.
#if defined(__AVX2__)
typedef __m256i Codes;

inline void to_floats(__m256i codes, v8 q[4]) {  // (signed bytes)
  const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
  q[0] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  q[1] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  q[2] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  q[3] = (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Q4_K's group g: sub-block 2g's codes (low nibbles) and 2g + 1's (high nibbles)
inline void q4_k_codes(const uint8_t* qs, v8 low[4], v8 high[4]) {
  const __m256i bytes = load32(qs), mask = _mm256_set1_epi8(0x0F);
  to_floats(_mm256_and_si256(bytes, mask), low);
  to_floats(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask), high);
}

// Q6_K's group g (0-3) of a half: 32 codes less 32
inline void q6_k_codes(const uint8_t* ql, const uint8_t* qh, int g, v8 q[4]) {
  const __m256i nib = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
  const __m256i lowbits = load32(ql + 32 * (g & 1)), highbits = load32(qh);
  const __m256i low = g < 2 ? _mm256_and_si256(lowbits, nib)
                            : _mm256_and_si256(_mm256_srli_epi16(lowbits, 4), nib);
  // bits 2g, 2g + 1 of each high-bit byte moved to bits 4, 5 (16-bit shifts: the bits that cross
  // into the next byte are masked off)
  __m256i high;
  if (g == 0) high = _mm256_slli_epi16(highbits, 4);
  else if (g == 1) high = _mm256_slli_epi16(highbits, 2);
  else if (g == 2) high = highbits;
  else high = _mm256_srli_epi16(highbits, 2);
  const __m256i codes = _mm256_or_si256(low, _mm256_and_si256(high, two));
  to_floats(_mm256_sub_epi8(codes, _mm256_set1_epi8(32)), q);
}
#else
typedef int8_t s8x8 __attribute__((vector_size(8)));

inline void to_floats(const int8_t codes[32], v8 q[4]) {
  for (int c = 0; c < 4; ++c) {
    s8x8 raw;
    std::memcpy(&raw, codes + 8 * c, 8);
    q[c] = __builtin_convertvector(raw, v8);
  }
}

inline void q4_k_codes(const uint8_t* qs, v8 low[4], v8 high[4]) {
  int8_t lo[32], hi[32];
  for (int i = 0; i < 32; ++i) {
    lo[i] = static_cast<int8_t>(qs[i] & 0x0F);
    hi[i] = static_cast<int8_t>(qs[i] >> 4);
  }
  to_floats(lo, low);
  to_floats(hi, high);
}

inline void q6_k_codes(const uint8_t* ql, const uint8_t* qh, int g, v8 q[4]) {
  int8_t codes[32];
  const uint8_t* lowbits = ql + 32 * (g & 1);
  for (int i = 0; i < 32; ++i) {
    const int low = g < 2 ? lowbits[i] & 0x0F : lowbits[i] >> 4;
    codes[i] = static_cast<int8_t>((low | (((qh[i] >> (2 * g)) & 3) << 4)) - 32);
  }
  to_floats(codes, q);
}
#endif

// Q4_K's 8 scales and 8 mins out of 12 bytes: bytes 0-3 hold scales 0-3 (low 6 bits) and the top
// 2 bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of scales 4-7
// (low nibble) and of mins 4-7 (high nibble).
inline void q4_k_scales(const uint8_t* p, float sc[8], float mn[8]) {
  for (int i = 0; i < 4; ++i) {
    sc[i] = static_cast<float>(p[i] & 63);
    mn[i] = static_cast<float>(p[i + 4] & 63);
    sc[i + 4] = static_cast<float>((p[i + 8] & 0x0F) | ((p[i] >> 6) << 4));
    mn[i + 4] = static_cast<float>((p[i + 8] >> 4) | ((p[i + 4] >> 6) << 4));
  }
}

// the dot product of 32 codes with 32 inputs, in one fixed order
inline v8 dot32(const v8 q[4], const float* x) {
  return fma8(q[3], load8(x + 24), fma8(q[2], load8(x + 16), fma8(q[1], load8(x + 8),
                                                                       q[0] * load8(x))));
}

// One Q4_K weight row against R input rows; xsum holds the sums of x over each 32 inputs.
template <int R>
void q4_k_row(const uint8_t* w, int64_t num_blocks, const float* x, int64_t x_stride,
              const float* xsum, int64_t xsum_stride, float* y, int64_t y_stride) {
  v8 acc[R];
  float mins[R];
  for (int j = 0; j < R; ++j) acc[j] = v8{}, mins[j] = 0.f;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = w + b * kbytes(kQ4_K);
    const float d = half_at(block), dmin = half_at(block + 2);
    float sc[8], mn[8];
    q4_k_scales(block + 4, sc, mn);
    for (int g = 0; g < 4; ++g) {
      v8 q[2][4];
      q4_k_codes(block + 16 + 32 * g, q[0], q[1]);
      for (int half = 0; half < 2; ++half) {
        const int s = 2 * g + half;
        const v8 scale = splat8(d * sc[s]);  // (float32 products, as the reference's)
        const float min = dmin * mn[s];
        for (int j = 0; j < R; ++j) {
          const int64_t at = b * kSuper + kGroup * s;
          acc[j] = fma8(scale, dot32(q[half], x + j * x_stride + at), acc[j]);
          mins[j] = fma1(min, xsum[j * xsum_stride + at / kGroup], mins[j]);
        }
      }
    }
  }
  for (int j = 0; j < R; ++j) y[j * y_stride] = sum8(acc[j]) - mins[j];
}

// One Q6_K weight row against R input rows.
template <int R>
void q6_k_row(const uint8_t* w, int64_t num_blocks, const float* x, int64_t x_stride,
              const float*, int64_t, float* y, int64_t y_stride) {
  v8 acc[R];
  for (int j = 0; j < R; ++j) acc[j] = v8{};
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = w + b * kbytes(kQ6_K);
    const float d = half_at(block + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    for (int h = 0; h < 2; ++h) {
      for (int g = 0; g < 4; ++g) {
        v8 q[4];
        q6_k_codes(block + 64 * h, block + 128 + 32 * h, g, q);
        const int s = 8 * h + 2 * g;  // the first of the group's two sub-blocks of 16
        const v8 first = splat8(d * static_cast<float>(scales[s]));
        const v8 second = splat8(d * static_cast<float>(scales[s + 1]));
        for (int j = 0; j < R; ++j) {
          const float* xg = x + j * x_stride + b * kSuper + 128 * h + kGroup * g;
          acc[j] = fma8(first, fma8(q[1], load8(xg + 8), q[0] * load8(xg)), acc[j]);
          acc[j] = fma8(second, fma8(q[3], load8(xg + 24), q[2] * load8(xg + 16)), acc[j]);
        }
      }
    }
  }
  for (int j = 0; j < R; ++j) y[j * y_stride] = sum8(acc[j]);
}

template <void (*ROW4)(const uint8_t*, int64_t, const float*, int64_t, const float*, int64_t,
                       float*, int64_t),
          void (*ROW1)(const uint8_t*, int64_t, const float*, int64_t, const float*, int64_t,
                       float*, int64_t)>
void all_rows(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const float* x,
              int64_t x_stride, const float* xsum, int64_t xsum_stride, int64_t M, float* y,
              int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = w + n * row_bytes;
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows)
        ROW4(row, num_blocks, x + m * x_stride, x_stride, xsum + m * xsum_stride, xsum_stride,
             y + m * N + n, N);
      for (; m < M; ++m)
        ROW1(row, num_blocks, x + m * x_stride, x_stride, xsum + m * xsum_stride, xsum_stride,
             y + m * N + n, N);
    }
  });
}

}  // namespace

at::Tensor gguf_kquant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format) {
  TORCH_CHECK(format == kQ4_K || format == kQ6_K, "gguf_kquant_linear: block format ", format,
              " is not one this op reads (Q4_K = 12, Q6_K = 14)");
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2, "gguf_kquant_linear: x must be (rows, in) and "
              "blocks (out, bytes per row), got x of ", x.sizes(), " and blocks of ",
              blocks.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf_kquant_linear: x must be float32, got ",
              x.scalar_type());
  TORCH_CHECK(blocks.scalar_type() == at::kByte, "gguf_kquant_linear: blocks must be uint8, got ",
              blocks.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(),
              "gguf_kquant_linear: CPU tensors only");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "gguf_kquant_linear: x's rows must be "
              "contiguous");
  TORCH_CHECK(blocks.is_contiguous(), "gguf_kquant_linear: blocks must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(K % kSuper == 0, "gguf_kquant_linear: x's features (", K,
              ") must be a multiple of ", kSuper);
  TORCH_CHECK(blocks.size(1) == K / kSuper * kbytes(format), "gguf_kquant_linear: ", K,
              " features need ", K / kSuper * kbytes(format), " bytes of blocks per row, got ",
              blocks.size(1));
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int64_t groups = K / kGroup;
  std::vector<float> xsum(format == kQ4_K ? M * groups : 0);  // (M, K / 32), Q4_K's mins
  for (int64_t m = 0; m < static_cast<int64_t>(xsum.size()) / groups; ++m)
    for (int64_t c = 0; c < groups; ++c) {
      const float* xg = xp + m * x.stride(0) + c * kGroup;
      xsum[m * groups + c] = sum8((load8(xg) + load8(xg + 8)) + (load8(xg + 16) + load8(xg + 24)));
    }
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (format == kQ4_K)
    all_rows<q4_k_row<kRows>, q4_k_row<1>>(wp, blocks.size(1), K / kSuper, xp, x.stride(0),
                                          xsum.data(), groups, M, yp, N);
  else
    all_rows<q6_k_row<kRows>, q6_k_row<1>>(wp, blocks.size(1), K / kSuper, xp, x.stride(0),
                                          nullptr, 0, M, yp, N);
  return y;
}

}  // namespace minipaged_cpu
