// An 8-bit KV cache in the CUDA kernels (lesson 18): the two 8-bit formats, their conversions
// to and from float, and the quantizer (the same arithmetic as minipaged/kernels/kv_quant.py).
//
//   int8          codes -127 .. 127, rounded half to even
//   fp8 e4m3 fn   1 sign, 4 exponent (bias 7), 3 mantissa bits; largest 448, no infinities,
//                 subnormals down to 2^-9; rounded to nearest even, as torch.float8_e4m3fn
//
// Each token's key (and value) of one kv head has one float32 scale = max |x| / the largest
// code (1 for an all-zero vector); code = x / scale. The conversions are written with integer
// and float operations only, so the CPU build of these files (csrc/cuda_on_cpu/) rounds exactly
// as the GPU does, and both as torch (tests/kernels/test_kv_quant_cuda_on_cpu.py checks every
// code and every tie).
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>

namespace minipaged {

// The byte of an fp8 e4m3 number: a type of its own, so that templates tell it from int8.
struct fp8_e4m3 {
  uint8_t bits;
};

constexpr float FP8_MAX = 448.f;
constexpr float INT8_MAX_CODE = 127.f;

template <typename C> struct CodeMax;
template <> struct CodeMax<int8_t> { static constexpr float value = INT8_MAX_CODE; };
template <> struct CodeMax<fp8_e4m3> { static constexpr float value = FP8_MAX; };

__host__ __device__ __forceinline__ float bits_to_float(uint32_t bits) {
  union { uint32_t u; float f; } v{bits};
  return v.f;
}
__host__ __device__ __forceinline__ uint32_t float_to_bits(float f) {
  union { float f; uint32_t u; } v{f};
  return v.u;
}

// fp8 e4m3 -> float: exact.
__host__ __device__ __forceinline__ float fp8_to_float(uint8_t code) {
  const uint32_t sign = (uint32_t)(code & 0x80) << 24;
  const uint32_t exponent = (code >> 3) & 0xF;
  const uint32_t mantissa = code & 0x7;
  if (exponent == 0) {  // subnormal: mantissa * 2^-9
    const float magnitude = (float)mantissa * 0.001953125f;
    return sign ? -magnitude : magnitude;
  }
  // normal: (1 + mantissa / 8) * 2^(exponent - 7): the float with that exponent and mantissa
  return bits_to_float(sign | ((exponent - 7 + 127) << 23) | (mantissa << 20));
}

// float (|y| <= 448, already clamped) -> fp8 e4m3, rounded to nearest even.
__host__ __device__ __forceinline__ uint8_t float_to_fp8(float y) {
  uint32_t bits = float_to_bits(y);
  const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
  bits &= 0x7FFFFFFFu;
  if (bits < 0x3C800000u) {  // below 2^-6: a subnormal code m means m * 2^-9
    // y * 512 is exact (a power of two); rint rounds half to even: m in 0 .. 8, and 8 is the
    // smallest normal number's code, 0x08.
    return sign | (uint8_t)rintf(bits_to_float(bits) * 512.f);
  }
  // normal: keep the top 3 of the 23 mantissa bits, rounding the other 20 to nearest even
  // (add just under half, plus the kept part's lowest bit), then move the exponent's bias from
  // 127 to 7. A carry out of the mantissa correctly bumps the exponent.
  const uint32_t odd = (bits >> 20) & 1;
  bits += 0x7FFFFu + odd;
  return sign | (uint8_t)(((bits >> 20) - ((127 - 7) << 3)) & 0x7F);
}

// Any element the kernels read, as float (explicit intrinsics: torch builds with the implicit
// half/bfloat16 conversions disabled).
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(int8_t c) { return (float)c; }
__device__ __forceinline__ float to_float(fp8_e4m3 c) { return fp8_to_float(c.bits); }
// ... and a float as T, rounded to nearest even (torch's rounding to a half or bfloat16 tensor).
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// y already clamped to [-max, max].
__host__ __device__ __forceinline__ void float_to_code(float y, int8_t& out) {
  out = (int8_t)rintf(y);  // half to even
}
__host__ __device__ __forceinline__ void float_to_code(float y, fp8_e4m3& out) {
  out.bits = float_to_fp8(y);
}

// The scale of a vector whose largest magnitude is amax.
template <typename C>
__host__ __device__ __forceinline__ float code_scale(float amax) {
  return amax > 0.f ? amax / CodeMax<C>::value : 1.f;
}

// x / scale, clamped to the format's range, as a code.
template <typename C>
__host__ __device__ __forceinline__ C quantize_one(float x, float scale) {
  const float qmax = CodeMax<C>::value;
  const float y = fminf(fmaxf(x / scale, -qmax), qmax);
  C code;
  float_to_code(y, code);
  return code;
}

}  // namespace minipaged
