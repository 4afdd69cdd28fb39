// The few-row float32 matmul's tiles (linear.cpp, lesson 15), shared with the GGUF op's
// tiles of dequantized rows (gguf_linear.cpp): see linear.cpp for the loop and its order.
#pragma once

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

}  // namespace minipaged_cpu
