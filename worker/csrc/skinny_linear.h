// y = x @ (w * scale)^T (+ bias) for a few fp32 input rows and a weight stored narrower than fp32:
// the linear of a decode or draft step with bf16 or int8 weights (fp32 ones: panel_linear.h).
//
// Such a step multiplies a handful of rows by every weight of the layer, and those weights come
// from memory each step, so the step waits on memory, not arithmetic: what counts is streaming the
// weight at the rate the core reads memory. One loop serves both narrow storages -- bf16, int8 with a
// scale per output feature -- converting each weight to fp32 as it is read; all arithmetic is fp32
// (docs/architecture.md, "Weights and kernels").
//
// Loop order: blocks of W::NB output features whose weight rows stay in L1 while every input row
// passes over them, so the weight is read from memory once whatever the row count. Inside a block,
// two features and up to four rows at a time: eight accumulators of 16 lanes each with AVX-512
// (8 with AVX2). The sums run in another order than MKL's, and a scale multiplies the finished sum
// (as torch's and vLLM's w8a16 GEMMs do), so results differ from a dequantize-then-GEMM reference by
// rounding only.
#pragma once

#include <ATen/Parallel.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#endif
#if defined(__AVX512F__)
#define PDSERVE_AVX512 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace skinny {

// How each storage type turns into fp32: 16 lanes (AVX-512), 8 lanes (AVX2), one element.
// NB keeps a block's weight rows (NB * K elements) within L1 for the K of real models.
struct BF16 {
  using T = uint16_t;
  static constexpr int64_t NB = 8;
  // bf16 -> fp32 is exact: widen to 32 bits and shift into the high half.
#ifdef PDSERVE_AVX512
  static __m512 load16(const T* w) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))), 16));
  }
#endif
#ifdef PDSERVE_AVX2
  static __m256 load8(const T* w) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16));
  }
#endif
  static float one(T h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
};

struct Int8 {
  using T = int8_t;
  static constexpr int64_t NB = 8;
  // Sign-extend to int32, convert (exact).
#ifdef PDSERVE_AVX512
  static __m512 load16(const T* w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  }
#endif
#ifdef PDSERVE_AVX2
  static __m256 load8(const T* w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
  }
#endif
  static float one(T w) { return static_cast<float>(w); }
};

// Each weight row is read once, front to back, a few KB at a time: too short a stream for the
// hardware prefetcher to run far enough ahead, and a step of few rows then waits on memory well
// below the bandwidth a plain copy gets. So each row's line this far ahead (the rows a few feature
// pairs on) is asked into L2 as the loop goes (benchmarks/results/quantization.md). Into L2, not
// L1: L1 is what holds the input rows. (locality 2: prefetcht1; a prefetch never faults, so
// running past the weight's end is harmless.)
constexpr int64_t PREFETCH_BYTES = 16384;

template <class W>
inline void prefetch_ahead(const typename W::T* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES, 0, 2);
}

// Whether the loop is at the start of a 64-byte line of the weight (one prefetch per line).
template <class W>
inline bool line_start(int64_t k) {
  return k % (64 / static_cast<int64_t>(sizeof(typename W::T))) == 0;
}

struct Out {
  const float* scale;  // per output feature, or null (1)
  const float* bias;   // or null
  float* y;
  int64_t N;
  void store(int64_t row, int64_t n, float sum) const {
    y[row * N + n] = sum * (scale ? scale[n] : 1.f) + (bias ? bias[n] : 0.f);
  }
};

// Finish features n and n + 1 of input row `row`: add the K tail from k0 (past the SIMD loop) to the
// vector sums s0, s1 and store.
template <class W>
inline void finish_pair(const float* x, int64_t K, const typename W::T* w0, const typename W::T* w1,
                        const Out& out, int64_t row, int64_t n, int64_t k0, float s0, float s1) {
  const float* xr = x + row * K;
  for (int64_t k = k0; k < K; ++k) {
    s0 += xr[k] * W::one(w0[k]);
    s1 += xr[k] * W::one(w1[k]);
  }
  out.store(row, n, s0);
  out.store(row, n + 1, s1);
}

// Rows [r0, r0 + R) of x against features [n0, n1) of w, the tail of K past the SIMD width included.
template <class W, int R>
void rows_times_block(const float* x, int64_t K, const typename W::T* w, const Out& out, int64_t r0, int64_t n0,
                      int64_t n1) {
  int64_t n = n0;
#ifdef PDSERVE_AVX512
  const int64_t kv = K - K % 16;
  for (; n + 2 <= n1; n += 2) {
    const typename W::T* w0 = w + n * K;
    const typename W::T* w1 = w0 + K;
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kv; k += 16) {
      if (line_start<W>(k)) {
        prefetch_ahead<W>(w0 + k);
        prefetch_ahead<W>(w1 + k);
      }
      const __m512 a = W::load16(w0 + k), b = W::load16(w1 + k);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_loadu_ps(x + (r0 + r) * K + k);
        acc[r][0] = _mm512_fmadd_ps(xv, a, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xv, b, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      finish_pair<W>(x, K, w0, w1, out, r0 + r, n, kv, _mm512_reduce_add_ps(acc[r][0]),
                     _mm512_reduce_add_ps(acc[r][1]));
  }
#elif defined(PDSERVE_AVX2)
  const int64_t kv = K - K % 8;
  for (; n + 2 <= n1; n += 2) {
    const typename W::T* w0 = w + n * K;
    const typename W::T* w1 = w0 + K;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kv; k += 8) {
      if (line_start<W>(k)) {
        prefetch_ahead<W>(w0 + k);
        prefetch_ahead<W>(w1 + k);
      }
      const __m256 a = W::load8(w0 + k), b = W::load8(w1 + k);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + (r0 + r) * K + k);
        acc[r][0] = _mm256_fmadd_ps(xv, a, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xv, b, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      // Both features' 8 lanes summed at once: hadd pairs them up, then the two 128-bit halves.
      const __m256 h = _mm256_hadd_ps(acc[r][0], acc[r][1]);  // a01 a23 b01 b23 | a45 a67 b45 b67
      const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      const __m128 t = _mm_hadd_ps(s, s);  // a b a b
      float sums[4];
      _mm_storeu_ps(sums, t);
      finish_pair<W>(x, K, w0, w1, out, r0 + r, n, kv, sums[0], sums[1]);
    }
  }
#endif
  for (; n < n1; ++n) {  // (an odd last feature, or every feature where there is no AVX2)
    const typename W::T* wn = w + n * K;
    for (int r = 0; r < R; ++r) {
      const float* xr = x + (r0 + r) * K;
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += xr[k] * W::one(wn[k]);
      out.store(r0 + r, n, sum);
    }
  }
}

// y[M, N] = x[M, K] @ (w[N, K] * scale[N])^T (+ bias); scale and bias may be null.
template <class W>
void linear(const float* x, int64_t M, int64_t K, const typename W::T* w, const float* scale, const float* bias,
            float* y, int64_t N) {
  const Out out{scale, bias, y, N};
  const int64_t blocks = (N + W::NB - 1) / W::NB;
  // Threads only for big weights: at decode sizes waking a second thread costs more than it saves.
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, W::NB * K * std::max<int64_t>(M, 1)));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * W::NB, n1 = std::min(N, n0 + W::NB);
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) rows_times_block<W, 4>(x, K, w, out, r, n0, n1);
      switch (M - r) {
        case 3: rows_times_block<W, 3>(x, K, w, out, r, n0, n1); break;
        case 2: rows_times_block<W, 2>(x, K, w, out, r, n0, n1); break;
        case 1: rows_times_block<W, 1>(x, K, w, out, r, n0, n1); break;
        default: break;
      }
    }
  });
}

}  // namespace skinny
