// Fused elementwise ops of the decoder layer on the CPU (fp32; RMSNorm in bf16 too), and argmax.
//
// At decode a step is a handful of rows, so what an op costs is mostly its dispatch: RMSNorm is
// seven torch ops (pow, mean, add, rsqrt, two muls, a cast), rotary embedding six. Each of these
// does the same arithmetic in one pass, element by element in the same order as the torch
// expression it replaces (worker/fused_ops.py holds those as the reference): rope is
// bit-identical to it; rms_norm accumulates its sum of squares in another order than torch's
// mean, a difference in the last bit of the scale at most. (SiLU-and-mul stays torch's: without
// -ffast-math GCC does not vectorise exp, and a scalar exp costs more than the dispatches.)
//
// Built without -ffast-math (worker/fused_ops.py): a contracted multiply-add would round
// differently from torch's separate multiply and add.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

// Rows per parallel task: threads only for big inputs (long prefills). At decode sizes waking a
// second thread costs more than the whole op, as in torch's own elementwise kernels.
int64_t grain(int64_t elements_per_row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, elements_per_row)); }

void check_fp32_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

template <typename scalar_t>
void rms_norm_rows(const scalar_t* src, int64_t stride, const scalar_t* w, scalar_t* dst, int64_t rows, int64_t n,
                   float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = src + r * stride;
      scalar_t* yr = dst + r * n;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        yr[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * (static_cast<float>(xr[i]) * scale));
    }
  });
}

// y = w * (x * 1/sqrt(mean(x^2) + eps)) over the last dimension; x's rows may be strided, each
// row contiguous. fp32, or bf16 computed in fp32 and rounded once (a bf16 MTP drafter's norms,
// which need no bit-exactness).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  weight.scalar_type() == x.scalar_type(),
              "x and weight must be CPU tensors of one dtype, float32 or bfloat16");
  const int64_t n = weight.numel();
  TORCH_CHECK(x.size(-1) == n && x.stride(-1) == 1, "x's last dimension must be contiguous and match weight");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  at::Tensor rows = x.reshape({-1, n});  // a view where the leading dimensions allow it
  at::Tensor out = at::empty({rows.size(0), n}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(rows.data_ptr<float>(), rows.stride(0), weight.data_ptr<float>(), out.data_ptr<float>(),
                  rows.size(0), n, static_cast<float>(eps));
  } else {
    rms_norm_rows(rows.data_ptr<at::BFloat16>(), rows.stride(0), weight.data_ptr<at::BFloat16>(),
                  out.data_ptr<at::BFloat16>(), rows.size(0), n, static_cast<float>(eps));
  }
  return out.view(x.sizes());
}

// x * cos + rotate_half(x) * sin for x [T, H, D] and cos/sin [T, 1, D] (any strides, D
// contiguous): transformers' apply_rotary_pos_emb, where rotate_half(x) = cat(-x[D/2:], x[:D/2]).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_fp32_cpu(x, "x");
  check_fp32_cpu(cos, "cos");
  check_fp32_cpu(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim] with head_dim contiguous");
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(0) == t && cos.size(1) == 1 &&
                  cos.size(2) == d && cos.stride(2) == 1 && sin.stride(2) == 1,
              "cos and sin must be [tokens, 1, head_dim] with head_dim contiguous");
  at::Tensor out = at::empty({t, h, d}, x.options());
  const float* src = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1), sc = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, t, grain(h * d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* ci = c + i * sc;
      const float* si = s + i * ss;
      for (int64_t j = 0; j < h; ++j) {
        const float* xr = src + i * st + j * sh;
        float* yr = dst + (i * h + j) * d;
        // Written as separate products and a sum, as torch computes them (no contraction here).
#pragma omp simd
        for (int64_t k = 0; k < half; ++k) {
          const float a = xr[k] * ci[k], b = -xr[k + half] * si[k];
          yr[k] = a + b;
        }
#pragma omp simd
        for (int64_t k = half; k < d; ++k) {
          const float a = xr[k] * ci[k], b = xr[k - half] * si[k];
          yr[k] = a + b;
        }
      }
    }
  });
  return out;
}

int64_t row_argmax(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vbest = _mm512_set1_ps(best);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    vbest = _mm512_max_ps(vbest, v);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  best = _mm512_reduce_max_ps(vbest);
  nan = unordered != 0;
#endif
  for (; i < n; ++i) {
    best = x[i] > best ? x[i] : best;
    nan = nan || x[i] != x[i];
  }
  int64_t at = 0;
#if defined(__AVX512F__)
  if (!nan) {
    const __m512 vb = _mm512_set1_ps(best);
    for (; at + 16 <= n; at += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + at), vb, _CMP_EQ_OQ);
      if (hit) return at + __builtin_ctz(hit);
    }
  }
#endif
  while (nan ? x[at] == x[at] : x[at] != best) ++at;  // what is sought is in the row: the scan stops
  return at;
}

// Index of each row's largest value, the first where several are equal (torch.argmax's rule),
// the first NaN where a row has one (torch's too). torch's CPU argmax tracks the index element
// by element; here a vectorised max then a scan for its first position, two quick passes.
at::Tensor argmax(const at::Tensor& logits) {
  check_fp32_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [rows, vocab] with rows contiguous");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* src = logits.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = row_argmax(src + r * stride, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
  m.impl("argmax", &argmax);
}
