// y = x @ w^T (+ bias) for a few fp32 input rows, the weight stored in panels: the linear of a
// decode or draft step with fp32 weights.
//
// Layout: panels[p][k][j] = w[p * P + j][k], P output features a panel, zero past the last feature
// (worker/models/linear.py, pack_panels). At each k the loop loads the panel's P weights once and
// multiplies them by every input row's x[r][k], broadcast: no input row is reloaded per feature and
// no sum needs a horizontal add. With the weight in rows (skinny_linear.h) every pair of features
// reloads all the input rows, and from about 8 rows those loads, not memory, set the pace
// (benchmarks/results/quantization.md, "Panels"). The sums run over k in order, one per output, so
// results differ from MKL's by rounding only.
//
// A panel is read front to back, and lines a fixed distance ahead are asked into L2 as the loop goes:
// a decode step streams every weight once, and without that the core waits on memory between its
// bursts of arithmetic instead of overlapping the two.
#pragma once

#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace panel {

// Two vectors of features a panel, and as many rows a pass as leave registers for the two weight
// vectors and the broadcast: 2 * ROWS accumulators.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t LANES = 16;
constexpr int ROWS = 8;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec broadcast(float v) { return _mm512_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#define PDSERVE_PANEL_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int64_t LANES = 8;
constexpr int ROWS = 6;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec broadcast(float v) { return _mm256_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#define PDSERVE_PANEL_SIMD 1
#else
constexpr int64_t LANES = 8;
constexpr int ROWS = 4;
#endif
constexpr int64_t P = 2 * LANES;

// How far ahead of the loop the weight is asked into L2 (locality 2: prefetcht1; a prefetch never
// faults, so running past the weight's end is harmless).
constexpr int64_t PREFETCH_FLOATS = 8192;

// Rows [0, R) of x (row stride K) times one panel w; features [n0, n0 + width) of y (row stride N).
template <int R>
void panel_rows(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t n0, int64_t width,
                const float* bias) {
  float sums[R][P];
#ifdef PDSERVE_PANEL_SIMD
  Vec acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = zero();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * P;
    for (int64_t line = 0; line < P; line += 16) __builtin_prefetch(wk + PREFETCH_FLOATS + line, 0, 2);
    const Vec a = load(wk), b = load(wk + LANES);
    for (int r = 0; r < R; ++r) {
      const Vec xv = broadcast(x[r * K + k]);
      acc[r][0] = fma(xv, a, acc[r][0]);
      acc[r][1] = fma(xv, b, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    store(sums[r], acc[r][0]);
    store(sums[r] + LANES, acc[r][1]);
  }
#else
  for (int r = 0; r < R; ++r) std::fill(sums[r], sums[r] + P, 0.f);
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < P; ++j) sums[r][j] += x[r * K + k] * w[k * P + j];
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < width; ++j) y[r * N + n0 + j] = sums[r][j] + (bias ? bias[n0 + j] : 0.f);
}

// The last M % ROWS rows: R counts down to that remainder.
template <int R>
void panel_tail(int rem, const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t n0, int64_t width,
                const float* bias) {
  if (rem == R) {
    panel_rows<R>(x, K, w, y, N, n0, width, bias);
  } else if constexpr (R > 1) {
    panel_tail<R - 1>(rem, x, K, w, y, N, n0, width, bias);
  }
}

// y[M, N] = x[M, K] @ w[N, K]^T (+ bias), w given as panels [ceil(N / P), K, P].
inline void linear(const float* x, int64_t M, int64_t K, const float* panels, const float* bias, float* y,
                   int64_t N) {
  const int64_t num_panels = (N + P - 1) / P;
  // Threads only for big weights: at decode sizes waking a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, P * K * std::max<int64_t>(M, 1)));
  at::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* w = panels + p * K * P;
      const int64_t n0 = p * P, width = std::min(P, N - n0);
      int64_t r = 0;
      // Later passes over a panel find it in L2: it is K * P floats.
      for (; r + ROWS <= M; r += ROWS) panel_rows<ROWS>(x + r * K, K, w, y + r * N, N, n0, width, bias);
      if (r < M) panel_tail<ROWS - 1>(static_cast<int>(M - r), x + r * K, K, w, y + r * N, N, n0, width, bias);
    }
  });
}

}  // namespace panel
