// linear_int8w: y = x @ (q * scale)^T (+ bias) for a few fp32 input rows against a weight stored
// as int8 with one fp32 scale per output feature (weight-only, per-channel symmetric: --quantization
// int8, worker/models/linear.py).
//
// Why a kernel of ours: torch's own weight-only int8 op (aten::_weight_int8pack_mm) has a
// vectorised CPU path only for bf16 activations; with fp32 ones it runs a scalar loop, and torchao's
// int8 weight-only tensor dequantizes the whole weight on every call in eager mode. oneDNN's int8
// matmuls in torch quantize the activation too, which changes the arithmetic
// (benchmarks/results/quantization.md). A decode step multiplies a handful of rows by every weight,
// and those weights come from memory each step, so a quarter of fp32's bytes is most of the time.
//
// Arithmetic: fp32 throughout. Each output is scale * sum_k x[k] * float(q[k]) (+ bias): the
// scale applied once to the sum, as torch's and vLLM's w8a16 GEMMs do, rather than to each weight
// (one multiply less per weight, in a loop bound by its conversions, not by memory). Against a
// reference that multiplies by the dequantized weight q * scale the difference is rounding noise,
// as is the order of the sums against MKL's.
//
// Loop order as in bf16_linear.cpp: blocks of NB output features whose weight rows (NB * K bytes)
// stay in L1 while every input row passes over them, two features and up to four rows at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#endif
#if defined(__AVX512F__)
#define PDSERVE_AVX512 1
#endif

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t NB = 8;  // output features per block

// Each weight row is read once, front to back, a few KB at a time: too short a stream for the
// hardware prefetcher to run far enough ahead, and a step of few rows then waits on memory well
// below the bandwidth a plain copy gets. So each row's line this far ahead (the rows a few feature
// pairs on) is asked into L2 as the loop goes (benchmarks/results/quantization.md). Into L2, not
// L1: L1 is what holds the input rows, and prefetching into it gained far less.
constexpr int64_t PREFETCH_BYTES = 16384;

// (locality 2: prefetcht1. A prefetch never faults, so running past the weight's end is harmless.)
inline void prefetch_l2(const int8_t* p) { __builtin_prefetch(p, 0, 2); }

// Finish features n and n + 1 of input row `row`: add the K tail from k0 (past the SIMD loop) to the
// vector sums s0, s1, then the bias, and store.
inline void finish_pair(const float* x, int64_t K, const int8_t* w0, const int8_t* w1, float c0, float c1,
                        const float* bias, float* y, int64_t N, int64_t row, int64_t n, int64_t k0, float s0,
                        float s1) {
  const float* xr = x + row * K;
  for (int64_t k = k0; k < K; ++k) {
    s0 += xr[k] * static_cast<float>(w0[k]);
    s1 += xr[k] * static_cast<float>(w1[k]);
  }
  y[row * N + n] = s0 * c0 + (bias ? bias[n] : 0.f);
  y[row * N + n + 1] = s1 * c1 + (bias ? bias[n + 1] : 0.f);
}

#ifdef PDSERVE_AVX512
// 16 int8 weights of a row as fp32: sign-extend to int32, convert (exact).
inline __m512 widen16(const int8_t* w) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}
#elif defined(PDSERVE_AVX2)
inline __m256 widen8(const int8_t* w) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}
#endif

// Rows [r0, r0 + R) of x against features [n0, n1) of w, the tail of K past the SIMD width included.
template <int R>
void rows_times_block(const float* x, int64_t K, const int8_t* w, const float* scale, const float* bias, float* y,
                      int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  int64_t n = n0;
#ifdef PDSERVE_AVX512
  const int64_t kv = K - K % 16;
  for (; n + 2 <= n1; n += 2) {
    const int8_t* w0 = w + n * K;
    const int8_t* w1 = w0 + K;
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kv; k += 16) {
      if (k % 64 == 0) {  // (one prefetch per 64-byte line of each row)
        prefetch_l2(w0 + PREFETCH_BYTES + k);
        prefetch_l2(w1 + PREFETCH_BYTES + k);
      }
      const __m512 a = widen16(w0 + k), b = widen16(w1 + k);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_loadu_ps(x + (r0 + r) * K + k);
        acc[r][0] = _mm512_fmadd_ps(xv, a, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xv, b, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      finish_pair(x, K, w0, w1, scale[n], scale[n + 1], bias, y, N, r0 + r, n, kv,
                  _mm512_reduce_add_ps(acc[r][0]), _mm512_reduce_add_ps(acc[r][1]));
  }
#elif defined(PDSERVE_AVX2)
  const int64_t kv = K - K % 8;
  for (; n + 2 <= n1; n += 2) {
    const int8_t* w0 = w + n * K;
    const int8_t* w1 = w0 + K;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kv; k += 8) {
      if (k % 64 == 0) {
        prefetch_l2(w0 + PREFETCH_BYTES + k);
        prefetch_l2(w1 + PREFETCH_BYTES + k);
      }
      const __m256 a = widen8(w0 + k), b = widen8(w1 + k);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + (r0 + r) * K + k);
        acc[r][0] = _mm256_fmadd_ps(xv, a, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xv, b, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      // Both features' 8 lanes summed at once: hadd pairs them up, then the two 128-bit halves.
      const __m256 h = _mm256_hadd_ps(acc[r][0], acc[r][1]);
      const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      const __m128 t = _mm_hadd_ps(s, s);
      float sums[4];
      _mm_storeu_ps(sums, t);
      finish_pair(x, K, w0, w1, scale[n], scale[n + 1], bias, y, N, r0 + r, n, kv, sums[0], sums[1]);
    }
  }
#endif
  for (; n < n1; ++n) {  // (an odd last feature, or every feature where there is no AVX2)
    const int8_t* wn = w + n * K;
    const float c = scale[n];
    for (int r = 0; r < R; ++r) {
      const float* xr = x + (r0 + r) * K;
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += xr[k] * static_cast<float>(wn[k]);
      y[(r0 + r) * N + n] = sum * c + (bias ? bias[n] : 0.f);
    }
  }
}

at::Tensor linear_int8w(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kChar && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) == x.size(1),
              "weight must be a contiguous [out, in] int8 CPU tensor matching x's columns");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == weight.size(0),
              "scale must be a contiguous float32 tensor of the weight's rows");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == weight.size(0),
                "bias must be a contiguous float32 tensor of the weight's rows");
    b = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + NB - 1) / NB;
  // Threads only for big weights: at decode sizes waking a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, NB * K * std::max<int64_t>(M, 1)));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * NB, n1 = std::min(N, n0 + NB);
      int64_t r = 0;
      for (; r + 4 <= M; r += 4) rows_times_block<4>(xp, K, wp, sp, b, yp, N, r, n0, n1);
      switch (M - r) {
        case 3: rows_times_block<3>(xp, K, wp, sp, b, yp, N, r, n0, n1); break;
        case 2: rows_times_block<2>(xp, K, wp, sp, b, yp, N, r, n0, n1); break;
        case 1: rows_times_block<1>(xp, K, wp, sp, b, yp, N, r, n0, n1); break;
        default: break;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(pdserve_int8, m) {
  m.def("linear_int8w(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_int8, CPU, m) {
  m.impl("linear_int8w", &linear_int8w);
}
