// The element-wise layers of a LLaMA block on the CPU, float32, one pass over memory each
// (lesson 15): the CPU cousins of csrc/layer_kernels.cu.
//
//   silu_and_mul(gate, up)        silu(gate) * up                    (the SwiGLU between the
//                                                                     MLP's two matmuls)
//   rms_norm(x, weight, eps)      weight * x / sqrt(mean(x^2) + eps)  (RMSNorm)
//   add_rms_norm(x, residual, .)  residual += x, then its RMSNorm     (the residual stream)
//   rotary(q, k, cos, sin, pos)   q and k rotated by their positions, in place (RoPE,
//                                 rotate-half layout)
//
// torch runs each as two to six operations, each a pass over memory and a call from Python.
// Here each row is read once and written once: in the throughput benchmark's decode step of 64
// sequences of SmolLM2, the model's work besides its matmuls and attention went from 48.4 ms to
// 40.2 ms (benchmarks/RESULTS.md, 2026-11-29).
//
// The exponential of silu is computed eight lanes at a time (`exp8`, the classic polynomial
// of Cephes' expf: within 2 ulp of std::exp); the rest is plain loops the compiler vectorises.
// Results equal torch's up to float rounding: sums taken in another order, an exponential a
// few ulp away.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace minipaged_cpu {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load8f(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8f(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

// e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial, 2^n put
// into the exponent bits. Inputs beyond +-88.38 are clamped (e^x would leave the float range).
inline v8f exp8(v8f x) {
  const v8f hi = v8f{} + 88.3762626647949f, lo = v8f{} - 88.3762626647949f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  v8f n = x * 1.44269504088896341f + 0.5f;  // x / ln2, rounded down below
  const v8f t = __builtin_convertvector(__builtin_convertvector(n, v8i), v8f);  // (toward 0)
  n = t - (t > n ? v8f{} + 1.f : v8f{});                                        // floor
  const v8f r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln2, in two parts
  v8f p = v8f{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;  // 2^n as a float's bits
  v8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Rows of a (T, D) tensor whose elements are contiguous (its rows may be strided).
inline void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2, what, " must be (tokens, features), got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat, what, ": float32 only, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, what, "'s rows must be contiguous");
}

// Rows per task: enough elements that a thread's share is worth waking it for.
inline int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
}

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate is ", gate.sizes(), " but up is ", up.sizes());
  const int64_t T = gate.size(0), D = gate.size(1);
  at::Tensor out = at::empty({T, D}, gate.options());
  const float* g = gate.data_ptr<float>();
  const float* u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t gs = gate.stride(0), us = up.stride(0);
  at::parallel_for(0, T, row_grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gr = g + t * gs;
      const float* ur = u + t * us;
      float* orow = o + t * D;
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) {  // silu(g) u = g u / (1 + e^-g)
        const v8f gv = load8f(gr + d);
        store8f(orow + d, gv * load8f(ur + d) / (1.f + exp8(-gv)));
      }
      for (; d < D; ++d) orow[d] = gr[d] * ur[d] / (1.f + std::exp(-gr[d]));
    }
  });
  return out;
}

// out[row] = weight * x[row] / sqrt(mean(x[row]^2) + eps); x's row also written to `copy` if given
inline void norm_row(const float* x, const float* weight, float* out, int64_t D, float eps) {
  v8f acc = v8f{};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const v8f v = load8f(x + d);
    acc += v * v;
  }
  float sum = 0.f;
  for (int lane = 0; lane < 8; ++lane) sum += acc[lane];
  for (; d < D; ++d) sum += x[d] * x[d];
  const float inv = 1.f / std::sqrt(sum / D + eps);
  for (d = 0; d < D; ++d) out[d] = weight[d] * (x[d] * inv);
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "weight must be a contiguous float32 vector of ", x.size(1), " elements, got ",
              weight.sizes(), " ", weight.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  const int64_t T = x.size(0), D = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, row_grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * xs, w, o + t * D, D, (float)eps);
  });
  return out;
}

// (rms_norm(x + residual), x + residual): the sum in a new tensor, as torch's `x + residual`
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                     const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x is ", x.sizes(), " but residual is ",
              residual.sizes());
  const int64_t T = x.size(0), D = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  at::Tensor total = at::empty({T, D}, x.options());
  at::Tensor out = at::empty({T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* tp = total.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, row_grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t d = 0; d < D; ++d) tp[t * D + d] = xp[t * xs + d] + rp[t * rs + d];
      norm_row(tp + t * D, w, o + t * D, D, (float)eps);
    }
  });
  return {out, total};
}

// q (T, H, D) and k (T, KVH, D) rotated by their positions, as new contiguous tensors:
//   out[i]       = x[i] cos[i] - x[i + D/2] sin[i]
//   out[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]      (i < D/2)
void rotate(const at::Tensor& x, const float* c, const float* s, float* out, int64_t t) {
  const int64_t H = x.size(1), D = x.size(2), half = D / 2;
  const float* xp = x.data_ptr<float>() + t * x.stride(0);
  for (int64_t h = 0; h < H; ++h) {
    const float* xh = xp + h * x.stride(1);
    float* oh = out + (t * H + h) * D;
    for (int64_t i = 0; i < half; ++i) {
      oh[i] = xh[i] * c[i] - xh[i + half] * s[i];
      oh[i + half] = xh[i + half] * c[i + half] + xh[i] * s[i + half];
    }
  }
}

std::vector<at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& cos,
                               const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k}) {
    const char* what = t == &q ? "q" : "k";
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kFloat && t->device().is_cpu(), what,
                " must be a float32 CPU tensor (tokens, heads, head_size), got ", t->sizes(),
                " ", t->scalar_type());
    TORCH_CHECK(t->stride(2) == 1, what, "'s heads must be contiguous");
  }
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D, "q is ", q.sizes(), " but k is ", k.sizes());
  TORCH_CHECK(D % 2 == 0, "head_size must be even, got ", D);
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == D &&
                  cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos and sin must be contiguous float32 (positions, ", D, "), got ", cos.sizes(),
              " and ", sin.sizes());
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T &&
                  positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be a contiguous int64 vector of ", T, " tokens, got ",
              positions.sizes(), " ", positions.scalar_type());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t P = cos.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "positions[", t, "] = ", pos[t],
                " is outside the rotary tables' [0, ", P, ")");
  at::Tensor q_out = at::empty({T, q.size(1), D}, q.options());
  at::Tensor k_out = at::empty({T, k.size(1), D}, k.options());
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qo = q_out.data_ptr<float>();
  float* ko = k_out.data_ptr<float>();
  at::parallel_for(0, T, row_grain((q.size(1) + k.size(1)) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate(q, cp + pos[t] * D, sp + pos[t] * D, qo, t);
      rotate(k, cp + pos[t] * D, sp + pos[t] * D, ko, t);
    }
  });
  return {q_out, k_out};
}

}  // namespace minipaged_cpu
