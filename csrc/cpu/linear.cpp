// A linear layer's matmul for a few rows, y = x W^T, on the CPU (lesson 15).
//
// Decode steps multiply a handful of rows (one per sequence) by every weight matrix of the
// model. BLAS libraries are built for big matrices: for a few rows they spend their time
// rearranging ("packing") the weights for a blocked kernel that then has little to do. On the
// 2-core AMD EPYC (AVX2) of 2026-11-29, SmolLM2's MLP down projection (576 x 1536) for 8 rows ran
// at 18-26 GFLOP/s in torch's three routines and at 39 GFLOP/s here (benchmarks/linear.py).
//
// The loop is the textbook one, arranged so that every load feeds several multiply-adds:
//
//   for each group of NB weight rows (output columns n .. n+NB-1), shared out among threads:
//     for each group of MB input rows (m .. m+MB-1):
//       NB x MB accumulators, each 8 floats wide (one 256-bit register)
//       walk k in steps of 8: load NB weight pieces and MB input pieces,
//                             NB x MB vector multiply-adds
//       y[m + j][n + i] = the 8 lanes of accumulator (i, j) added up (then the k % 8 tail)
//
// The weights are read once, in order (the hardware prefetcher streams them); the few input rows
// stay in the cache. Each output is computed by one thread, in one fixed order (8 lanes over k,
// then the lanes in turn), so a row's result does not depend on the other rows of the batch or
// on the number of threads.
//
// `v8` is a GCC/Clang vector of 8 floats: on AVX2 one register and one instruction per
// operation, elsewhere the compiler splits it (SSE, NEON). float32 only: the caller (cpu_matmul)
// uses torch's routines for other types.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>

#include "vec8.h"

namespace minipaged_cpu {

// NB weight rows times MB input rows: y[j * y_stride + i] for i < NB, j < MB.
template <int NB, int MB>
inline void linear_tile(const float* x, int64_t x_stride, const float* w, int64_t K, float* y,
                        int64_t y_stride) {
  v8 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = v8{};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    v8 wv[NB];
    for (int i = 0; i < NB; ++i) wv[i] = load8(w + i * K + k);
    for (int j = 0; j < MB; ++j) {
      const v8 xv = load8(x + j * x_stride + k);
      for (int i = 0; i < NB; ++i) acc[i][j] = fma8(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) {
      float sum = 0.f;
      for (int lane = 0; lane < 8; ++lane) sum += acc[i][j][lane];
      for (int64_t kk = k; kk < K; ++kk) sum = fma1(w[i * K + kk], x[j * x_stride + kk], sum);
      y[j * y_stride + i] = sum;
    }
}

// 3 x 4 accumulators + 3 weight pieces: 15 of AVX2's 16 vector registers. (4 x 3, 2 x 6, 4 x 2 and
// 6 x 2 ran 2-25 % slower on SmolLM2's shapes at 8, 24 and 64 rows, 2026-11-29.)
constexpr int NB = 3;  // weight rows per tile
constexpr int MB = 4;  // input rows per tile

// Weight rows [n, n + NB_) against every input row.
template <int NB_>
void linear_rows(const float* x, int64_t x_stride, int64_t M, const float* w, int64_t K,
                 float* y, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + MB <= M; m += MB)
    linear_tile<NB_, MB>(x + m * x_stride, x_stride, w + n * K, K, y + m * N + n, N);
  for (; m < M; ++m)
    linear_tile<NB_, 1>(x + m * x_stride, x_stride, w + n * K, K, y + m * N + n, N);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "linear: x must be (rows, in) and weight "
              "(out, in), got x of ", x.sizes(), " and weight of ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "linear: float32 only, got x ", x.scalar_type(), " and weight ",
              weight.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear: CPU tensors only");
  TORCH_CHECK(x.size(1) == weight.size(1), "linear: x has ", x.size(1),
              " features but weight takes ", weight.size(1));
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "linear: x's rows must be contiguous");
  TORCH_CHECK(weight.is_contiguous(), "linear: weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const int64_t num_tiles = (N + NB - 1) / NB;
  // grain: 16 tiles (64 weight rows) at least per thread, so a small matrix stays on one
  at::parallel_for(0, num_tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * NB;
      if (n + NB <= N) {
        linear_rows<NB>(xp, x_stride, M, wp, K, yp, N, n);
      } else {
        for (int64_t r = n; r < N; ++r) linear_rows<1>(xp, x_stride, M, wp, K, yp, N, r);
      }
    }
  });
  return y;
}

}  // namespace minipaged_cpu
