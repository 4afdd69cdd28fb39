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

#include "linear_tile.h"

namespace minipaged_cpu {

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
