// 8-float vectors and fused multiply-adds, shared by the C++ CPU op's matmul loops (linear.cpp,
// gguf_linear.cpp, gguf_kquants.cpp), and the float16 scale a GGUF block starts with.
//
// `v8` is a GCC/Clang vector of 8 floats: on AVX2 one register and one instruction per
// operation, elsewhere the compiler splits it (SSE, NEON).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#if defined(__FMA__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace minipaged_cpu {

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));  // (no alignment assumed)
  return v;
}

// a * b + c. NOTE: written out, never left to the compiler: free to fuse a multiply and an add
// into one instruction (one rounding instead of two), it fused the k % 8 tail in one tile shape
// and not in another on an AVX-512 Xeon, and a row's result then depended on its batch.
inline float fma1(float a, float b, float c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;  // (no fused instruction here: nothing to choose between)
#endif
}
inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#elif defined(__ARM_FEATURE_FMA)
  v8 r;
  for (int l = 0; l < 8; ++l) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return r;
#else
  return a * b + c;
#endif
}

inline v8 splat8(float v) { return v8{v, v, v, v, v, v, v, v}; }

inline float sum8(v8 v) {  // (lane by lane, in order: the same sum whatever the tile)
  float s = 0.f;
  for (int l = 0; l < 8; ++l) s += v[l];
  return s;
}

// The float16 at p (a GGUF block's scale), as float32: exact either way.
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // (one instruction)
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// The two float16s at p (a Q4_1 block's d and m, a K-quant's d and dmin), as float32.
inline void half_pair_at(const uint8_t* p, float& first, float& second) {
#if defined(__F16C__)
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));  // (one load)
  first = _mm_cvtss_f32(both);
  second = _mm_cvtss_f32(_mm_movehdup_ps(both));
#else
  first = half_at(p);
  second = half_at(p + 2);
#endif
}

}  // namespace minipaged_cpu
