// Fused elementwise ops of the decoder layer on the CPU (fp32; RMSNorm in bf16 too), argmax, and
// the step's token bookkeeping (at the end of the file).
//
// At decode a step is a handful of rows, so what an op costs is mostly its dispatch: RMSNorm is
// seven torch ops (pow, mean, add, rsqrt, two muls, a cast), rotary embedding six. Each of these
// does the same arithmetic in one pass, element by element in the same order as the torch
// expression it replaces (worker/fused_ops.py holds those as the reference): rope is
// bit-identical to it; rms_norm accumulates its sum of squares in another order than torch's
// mean, a difference in the last bit of the scale at most. silu_and_mul takes its exp from
// vec_exp.h (torch's is Sleef's): the two differ in the last bits, as oneDNN's fused SiLU of the
// prefill path does too; transformers' greedy output is what the tests hold it to.
//
// Built without -ffast-math (worker/fused_ops.py): a contracted multiply-add would round
// differently from torch's separate multiply and add.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec_exp.h"

namespace {

// Rows per parallel task: threads only for big inputs (long prefills). At decode sizes waking a
// second thread costs more than the whole op, as in torch's own elementwise kernels.
int64_t grain(int64_t elements_per_row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, elements_per_row)); }

void check_fp32_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

// Not inlined: one compiled body, so every op that norms a row (rms_norm, add_rms_norm,
// qk_norm_rope) sums its squares in the same order and gives the same bits.
template <typename scalar_t>
__attribute__((noinline)) void rms_norm_row(const scalar_t* xr, const scalar_t* w, scalar_t* yr, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    yr[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * (static_cast<float>(xr[i]) * scale));
}

template <typename scalar_t>
void rms_norm_rows(const scalar_t* src, int64_t stride, const scalar_t* w, scalar_t* dst, int64_t rows, int64_t n,
                   float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(src + r * stride, w, dst + r * n, n, eps);
  });
}

// A [rows, n] view of x's leading dimensions, each row contiguous (x's own storage where it can be).
at::Tensor fp32_rows(const at::Tensor& x, int64_t n, const char* name) {
  check_fp32_cpu(x, name);
  TORCH_CHECK(x.size(-1) == n && x.stride(-1) == 1, name, "'s last dimension must be contiguous and of size ", n);
  at::Tensor rows = x.reshape({-1, n});
  return rows.stride(0) >= n ? rows : rows.contiguous();
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

// (x + residual, rms_norm(x + residual)): a decoder layer's residual add and the norm that follows
// it. The sum is torch's x + residual to the bit; the norm is rms_norm's.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  const int64_t n = weight.numel();
  check_fp32_cpu(weight, "weight");
  TORCH_CHECK(weight.is_contiguous() && x.sizes() == residual.sizes(), "x and residual must be of one shape");
  const at::Tensor xs = fp32_rows(x, n, "x"), rs = fp32_rows(residual, n, "residual");
  const int64_t rows = xs.size(0);
  at::Tensor sum = at::empty({rows, n}, x.options()), out = at::empty({rows, n}, x.options());
  const float *xp = xs.data_ptr<float>(), *rp = rs.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t sx = xs.stride(0), sr = rs.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* s = sp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) s[i] = xp[r * sx + i] + rp[r * sr + i];
      rms_norm_row(s, w, op + r * n, n, e);
    }
  });
  return {sum.view(x.sizes()), out.view(x.sizes())};
}

// One head's x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]).
inline void rope_row(const float* xr, const float* ci, const float* si, float* yr, int64_t d) {
  const int64_t half = d / 2;
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

void check_rope_args(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_fp32_cpu(x, "x");
  check_fp32_cpu(cos, "cos");
  check_fp32_cpu(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim] with head_dim contiguous");
  const int64_t t = x.size(0), d = x.size(2);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(0) == t && cos.size(1) == 1 &&
                  cos.size(2) == d && cos.stride(2) == 1 && sin.stride(2) == 1,
              "cos and sin must be [tokens, 1, head_dim] with head_dim contiguous");
}

// x * cos + rotate_half(x) * sin for x [T, H, D] and cos/sin [T, 1, D] (any strides, D
// contiguous): transformers' apply_rotary_pos_emb. With num_q >= 0, each head is first
// RMS-normed (Qwen3's q_norm and k_norm): heads below num_q by q_weight, the rest by k_weight.
at::Tensor rope_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_q,
                     const float* q_weight, const float* k_weight, float eps) {
  check_rope_args(x, cos, sin);
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2);
  at::Tensor out = at::empty({t, h, d}, x.options());
  const float* src = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1), sc = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, t, grain(h * d), [&](int64_t begin, int64_t end) {
    std::vector<float> normed(num_q >= 0 ? d : 0);
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t j = 0; j < h; ++j) {
        const float* xr = src + i * st + j * sh;
        if (num_q >= 0) {
          rms_norm_row(xr, j < num_q ? q_weight : k_weight, normed.data(), d, eps);
          xr = normed.data();
        }
        rope_row(xr, c + i * sc, s + i * ss, dst + (i * h + j) * d, d);
      }
    }
  });
  return out;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_impl(x, cos, sin, -1, nullptr, nullptr, 0.f);
}

// rope(cat(rms_norm(x[:, :num_q], q_weight), rms_norm(x[:, num_q:], k_weight), 1), cos, sin): a
// Qwen3 layer's query and key heads normed and rotated in one op instead of four.
at::Tensor qk_norm_rope(const at::Tensor& x, int64_t num_q, const at::Tensor& q_weight, const at::Tensor& k_weight,
                        double eps, const at::Tensor& cos, const at::Tensor& sin) {
  check_fp32_cpu(q_weight, "q_weight");
  check_fp32_cpu(k_weight, "k_weight");
  TORCH_CHECK(x.dim() == 3 && 0 <= num_q && num_q <= x.size(1), "num_q must lie in [0, heads]");
  TORCH_CHECK(q_weight.is_contiguous() && k_weight.is_contiguous() && q_weight.numel() == x.size(2) &&
                  k_weight.numel() == x.size(2),
              "q_weight and k_weight must be contiguous, of head_dim elements");
  return rope_impl(x, cos, sin, num_q, q_weight.data_ptr<float>(), k_weight.data_ptr<float>(),
                   static_cast<float>(eps));
}

// silu(g) * u for x = [g | u] ([rows, 2n], rows contiguous): the gated MLP's activation. sigmoid(g)
// is 1 / (1 + e) for g >= 0 and e / (1 + e) below, with e = exp(-|g|) <= 1, so exp never overflows.
inline float silu_mul(float g, float u) {
  const float e = std::exp(-std::fabs(g));
  return g * ((g >= 0.f ? 1.f : e) / (1.f + e)) * u;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_fp32_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.stride(1) == 1,
              "x must be [rows, 2 * n] with its rows contiguous");
  const int64_t rows = x.size(0), n = x.size(1) / 2, stride = x.stride(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *g = src + r * stride, *u = g + n;
      float* y = dst + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= n; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));  // exp(-|g|)
        const __mmask16 neg = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 sig = _mm512_div_ps(_mm512_mask_mov_ps(one, neg, e), _mm512_add_ps(one, e));
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + i)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
      for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp_nonpositive_avx2(_mm256_or_ps(gv, sign));  // exp(-|g|)
        const __m256 neg = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < n; ++i) y[i] = silu_mul(g[i], u[i]);
    }
  });
  return out;
}

// k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t]: a layer's K/V of a step into the paged
// cache, both in one op (two index_copy_ otherwise). Caches [slots, H, D] contiguous; k and v
// [T, H, D] with D contiguous.
void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  check_fp32_cpu(k_cache, "k_cache");
  check_fp32_cpu(v_cache, "v_cache");
  check_fp32_cpu(k, "k");
  check_fp32_cpu(v, "v");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 3,
              "k_cache and v_cache must be contiguous [slots, heads, head_dim] of one shape");
  const int64_t T = k.size(0), H = k_cache.size(1), D = k_cache.size(2), num_slots = k_cache.size(0);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == H && k.size(2) == D && k.stride(2) == 1 &&
                  v.stride(2) == 1,
              "k and v must be [tokens, heads, head_dim] as the caches, head_dim contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
              "slots must be a contiguous int64 tensor of one slot a token");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(0 <= slot[t] && slot[t] < num_slots, "slot out of range");
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  at::parallel_for(0, T, grain(2 * H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < H; ++h) {
        std::copy_n(kp + t * k.stride(0) + h * k.stride(1), D, kc + (slot[t] * H + h) * D);
        std::copy_n(vp + t * v.stride(0) + h * v.stride(1), D, vc + (slot[t] * H + h) * D);
      }
  });
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
  if (nan) {  // (rare) NaN counts as -inf: one scalar pass, whose `>` is false for NaN
    best = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i)
      if (x[i] > best) best = x[i], at = i;
    return at;
  }
#if defined(__AVX512F__)
  const __m512 vb = _mm512_set1_ps(best);
  for (; at + 16 <= n; at += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + at), vb, _CMP_EQ_OQ);
    if (hit) return at + __builtin_ctz(hit);
  }
#endif
  while (x[at] != best) ++at;  // what is sought is in the row: the scan stops
  return at;
}

// Index of each row's largest value, the first where several are equal (torch.argmax's rule).
// NaN counts as -inf (torch's argmax picks the first NaN): a sampled id is never chosen for being
// NaN, and a row of nothing but NaN and -inf gives 0. torch's CPU argmax tracks the index element
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

// ---- Inverse-CDF sampling: the first token whose running mass exceeds u times the total (a token
// of zero mass is never picked; should rounding leave the running sum short, the last token of
// nonzero mass). A sum in vocabulary order is one long chain of dependent additions, bound by the
// add latency rather than throughput; here each block of kCdfBlock tokens is summed with 8
// independent partial sums (vectorised without reassociating anything), the blocks are walked to
// the one where the running mass crosses the target, and only that block is scanned token by token.
// The sums round differently from a sum in order, which moves a uniform that sits on a boundary
// in its last bit.
constexpr int64_t kCdfBlock = 64;

float block_sum(const float* x, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += x[i + j];
  float tail = 0.f;
  for (; i < n; ++i) tail += x[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

// `sums`: scratch of ceil(V / kCdfBlock) floats.
int64_t inverse_cdf(const float* dist, int64_t V, float u, std::vector<float>& sums) {
  const int64_t blocks = (V + kCdfBlock - 1) / kCdfBlock;
  float mass = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    sums[b] = block_sum(dist + b * kCdfBlock, std::min(kCdfBlock, V - b * kCdfBlock));
    mass += sums[b];
  }
  const float target = u * mass;
  float run = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    if (run + sums[b] <= target) {
      run += sums[b];
      continue;
    }
    const int64_t end = std::min(V, (b + 1) * kCdfBlock);
    for (int64_t v = b * kCdfBlock; v < end; ++v) {  // (in order: may fall short of the block's sum)
      if (dist[v] > 0.f && (run += dist[v]) > target) return v;
    }
  }
  for (int64_t v = V - 1; v > 0; --v)
    if (dist[v] > 0.f) return v;
  return 0;
}

// ---- Verifying drafts drawn independently from a draft distribution q (DraftMode.INDEPENDENT):
// the standard speculative rejection sampler (Leviathan et al. 2023) for rows sampled at a plain
// temperature. Row r verifies num_drafts[r] = k drafts with logits rows [start, start + k] (its
// positions back to back, rows in order); p_j = softmax(logits_j / temperature[r]). Draft j is
// accepted while accept_u * q_j(d_j) < p_j(d_j) (probability min(1, p/q)); at the first rejection
// the token is drawn from max(0, p_j - q_j) (p_j itself where that is all zero), else the bonus from
// p_k. That draw is by inverse CDF with one uniform final_u[r]: the first token whose running mass
// exceeds final_u[r] times the total (a token of zero mass is never picked), as Sampler.sample_from_probs
// draws an unkeyed row (V uniforms and their logs cost many times the pass). q [sum k, Vd] covers the draft vocabulary
// vocab_ids (int64 [Vd]; empty: the whole vocabulary). Returns [rows, 2] int64: the number of
// accepted drafts and the token after them. worker/fused_ops.py holds the torch reference; the
// torch RejectionSampler takes ~20 dispatches for what is a few passes over the vocabulary here.
at::Tensor rejection_verify(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& num_drafts,
                            const at::Tensor& drafts, const at::Tensor& q, const at::Tensor& vocab_ids,
                            const at::Tensor& accept_u, const at::Tensor& final_u) {
  check_fp32_cpu(logits, "logits");
  const int64_t R = num_drafts.numel(), V = logits.size(1), Vd = q.dim() == 2 ? q.size(1) : 0;
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "rejection_verify: logits must be contiguous [positions, vocab]");
  TORCH_CHECK(num_drafts.scalar_type() == at::kInt && num_drafts.is_contiguous() && drafts.scalar_type() == at::kInt &&
                  drafts.is_contiguous(), "rejection_verify: num_drafts and drafts must be contiguous int32");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.numel() == R && temperature.is_contiguous(),
              "rejection_verify: temperature [rows] float32");
  const int32_t* nd = num_drafts.data_ptr<int32_t>();
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(nd[r] >= 0, "rejection_verify: negative num_drafts");
    total += nd[r];
  }
  TORCH_CHECK(logits.size(0) == total + R, "rejection_verify: logits must have sum(1 + k) rows");
  TORCH_CHECK(drafts.numel() == total && accept_u.numel() == total && accept_u.scalar_type() == at::kFloat &&
                  accept_u.is_contiguous(), "rejection_verify: drafts and accept_u need one entry per draft");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && (total == 0 || (q.dim() == 2 && q.size(0) == total)),
              "rejection_verify: q must be contiguous float32 [drafts, draft vocab]");
  TORCH_CHECK(vocab_ids.numel() ? (vocab_ids.scalar_type() == at::kLong && vocab_ids.numel() == Vd &&
                                   vocab_ids.is_contiguous())
                                : (total == 0 || Vd == V),
              "rejection_verify: vocab_ids must be the int64 id of each q column (or empty with q over the vocabulary)");
  TORCH_CHECK(final_u.scalar_type() == at::kFloat && final_u.is_contiguous() && final_u.numel() == R,
              "rejection_verify: final_u must be [rows] float32");
  // The pass with a transcendental per entry as a torch op (vectorised, unlike a scalar loop built
  // without -ffast-math): every position's p.
  at::Tensor temps = at::empty({logits.size(0), 1}, logits.options());
  const float* t = temperature.data_ptr<float>();
  for (int64_t r = 0, pos = 0; r < R; pos += nd[r] + 1, ++r)
    std::fill(temps.data_ptr<float>() + pos, temps.data_ptr<float>() + pos + nd[r] + 1, t[r]);
  at::Tensor scaled = logits / temps;
  at::Tensor probs = at::softmax(scaled, 1);
  // Non-finite logits (fused_ops.py, "non-finite logits"): a NaN or +inf logit, or a row without a
  // finite one, makes the softmax's sum and so its whole row NaN -- one look per row finds them. Then
  // (rarely) again with NaN as -inf and +inf as the largest float (such tokens share the mass); a row
  // with no finite logit has no mass at all (zeros), so inverse_cdf gives token 0 there.
  const int64_t positions = probs.size(0);
  const float* first = probs.data_ptr<float>();
  for (int64_t p = 0; p < positions; ++p) {
    if (first[p * V] != first[p * V]) {
      const double inf = std::numeric_limits<double>::infinity();
      probs = at::softmax(scaled.nan_to_num_(-inf, std::numeric_limits<float>::max(), -inf), 1).nan_to_num_(0., 0., 0.);
      break;
    }
  }
  const float* pp = probs.data_ptr<float>();
  const float* fu = final_u.data_ptr<float>();
  const int32_t* dp = drafts.data_ptr<int32_t>();
  const float* qp = total ? q.data_ptr<float>() : nullptr;
  const int64_t* ids = vocab_ids.numel() ? vocab_ids.data_ptr<int64_t>() : nullptr;
  const float* au = accept_u.data_ptr<float>();
  at::Tensor out = at::empty({R, 2}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  std::vector<float> dense(V), residual(V), block_sums((V + kCdfBlock - 1) / kCdfBlock);
  for (int64_t r = 0, pos = 0, d0 = 0; r < R; pos += nd[r] + 1, d0 += nd[r], ++r) {
    int64_t m = 0;
    const float* dist = nullptr;  // the distribution of the token after the accepted drafts
    for (; m < nd[r]; ++m) {
      const float* p = pp + (pos + m) * V;
      const int64_t d = dp[d0 + m];
      TORCH_CHECK(d >= 0 && d < V, "rejection_verify: draft token out of range");
      std::fill(dense.begin(), dense.end(), 0.f);
      const float* qrow = qp + (d0 + m) * Vd;
      for (int64_t i = 0; i < Vd; ++i) dense[ids ? ids[i] : i] = qrow[i];
      if (au[d0 + m] * dense[d] < p[d]) continue;
      float left = 0.f;  // rejected: the residual max(0, p - q), or p where that is all zero
      for (int64_t v = 0; v < V; ++v) left += (residual[v] = std::max(0.f, p[v] - dense[v]));
      dist = left > 0.f ? residual.data() : p;
      break;
    }
    if (dist == nullptr) dist = pp + (pos + m) * V;  // every draft accepted: the bonus from p_k
    op[2 * r] = m;
    op[2 * r + 1] = inverse_cdf(dist, V, fu[r], block_sums);
  }
  return out;
}

// ---- A step's token bookkeeping (worker/kernels.py): the Triton kernels' per-row loops, for CPU
// tensors. The torch references are vectorised over every token of the step (~20 ops each), which
// at decode cost more than the whole rest of the runner's host work; here one pass over the rows.
// Same clamps as those: a bad step can lose tokens, never write outside its row or slot.

void check_i32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.is_contiguous(), name,
              " must be a contiguous int32 CPU tensor");
}

// A slot outside the tables would be a write anywhere in memory (torch raises an IndexError there).
void check_slots(const at::Tensor& idx_mapping, int64_t num_slots) {
  const int32_t* slot = idx_mapping.data_ptr<int32_t>();
  for (int64_t b = 0; b < idx_mapping.numel(); ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < num_slots, "idx_mapping[", b, "] = ", slot[b], " is not a slot");
}

void check_rows(const at::Tensor& idx_mapping, const at::Tensor& is_prefilling, const at::Tensor& qsl) {
  check_i32(idx_mapping, "idx_mapping");
  check_i32(qsl, "query_start_loc");
  TORCH_CHECK(is_prefilling.device().is_cpu() && is_prefilling.scalar_type() == at::kBool &&
                  is_prefilling.is_contiguous() && is_prefilling.numel() == idx_mapping.numel() &&
                  qsl.numel() == idx_mapping.numel() + 1,
              "is_prefilling [B] bool and query_start_loc [B+1] must match idx_mapping [B]");
}

void gather_prefill_tokens(at::Tensor input_ids, const at::Tensor& all_token_ids, const at::Tensor& idx_mapping,
                           const at::Tensor& query_start_loc, const at::Tensor& num_computed,
                           const at::Tensor& is_prefilling) {
  check_i32(input_ids, "input_ids");
  check_i32(all_token_ids, "all_token_ids");
  check_i32(num_computed, "num_computed_tokens");
  check_rows(idx_mapping, is_prefilling, query_start_loc);
  check_slots(idx_mapping, all_token_ids.size(0));
  const int64_t rows = idx_mapping.numel(), tokens = input_ids.numel(), len = all_token_ids.size(1);
  int32_t* dst = input_ids.data_ptr<int32_t>();
  const int32_t* table = all_token_ids.data_ptr<int32_t>();
  const int32_t *slot = idx_mapping.data_ptr<int32_t>(), *qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* computed = num_computed.data_ptr<int32_t>();
  const bool* prefilling = is_prefilling.data_ptr<bool>();
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t start = qsl[b], c = computed[b];
    const int64_t n = std::min({int64_t(qsl[b + 1]) - start, len - c, tokens - start});
    if (!prefilling[b] || n <= 0 || start < 0 || c < 0) continue;
    std::copy_n(table + int64_t(slot[b]) * len + c, n, dst + start);
  }
}

void combine_sampled_and_draft_tokens(at::Tensor input_ids, const at::Tensor& last_sampled_tokens,
                                      const at::Tensor& draft_tokens, const at::Tensor& num_draft_tokens,
                                      const at::Tensor& idx_mapping, const at::Tensor& query_start_loc,
                                      const at::Tensor& is_prefilling) {
  check_i32(input_ids, "input_ids");
  check_i32(last_sampled_tokens, "last_sampled_tokens");
  check_i32(draft_tokens, "draft_tokens");
  check_i32(num_draft_tokens, "num_draft_tokens");
  check_rows(idx_mapping, is_prefilling, query_start_loc);
  check_slots(idx_mapping, std::min(last_sampled_tokens.numel(), draft_tokens.size(0)));
  const int64_t rows = idx_mapping.numel(), tokens = input_ids.numel(), k_max = draft_tokens.size(1);
  int32_t* dst = input_ids.data_ptr<int32_t>();
  const int32_t *last = last_sampled_tokens.data_ptr<int32_t>(), *drafts = draft_tokens.data_ptr<int32_t>();
  const int32_t *num_drafts = num_draft_tokens.data_ptr<int32_t>(), *slot = idx_mapping.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const bool* prefilling = is_prefilling.data_ptr<bool>();
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t start = qsl[b], n = std::min(int64_t(qsl[b + 1]) - start, tokens - start);
    if (prefilling[b] || n <= 0 || start < 0) continue;
    const int64_t s = slot[b];
    dst[start] = last[s];
    const int64_t k = std::min({int64_t(num_drafts[b]), n - 1, k_max});
    for (int64_t j = 0; j < k; ++j) dst[start + 1 + j] = drafts[s * k_max + j];
  }
}

void post_step_update(at::Tensor all_token_ids, at::Tensor total_len, at::Tensor last_sampled_tokens,
                      const at::Tensor& sampled_token_ids, const at::Tensor& num_sampled,
                      const at::Tensor& idx_mapping) {
  check_i32(all_token_ids, "all_token_ids");
  check_i32(total_len, "total_len");
  check_i32(last_sampled_tokens, "last_sampled_tokens");
  check_i32(sampled_token_ids, "sampled_token_ids");
  check_i32(num_sampled, "num_sampled");
  check_i32(idx_mapping, "idx_mapping");
  TORCH_CHECK(sampled_token_ids.dim() == 2 && sampled_token_ids.size(0) == idx_mapping.numel() &&
                  num_sampled.numel() == idx_mapping.numel(),
              "sampled_token_ids [B, M] and num_sampled [B] must match idx_mapping [B]");
  check_slots(idx_mapping, std::min({all_token_ids.size(0), total_len.numel(), last_sampled_tokens.numel()}));
  const int64_t rows = idx_mapping.numel(), width = sampled_token_ids.size(1), len = all_token_ids.size(1);
  int32_t *table = all_token_ids.data_ptr<int32_t>(), *total = total_len.data_ptr<int32_t>();
  int32_t* last = last_sampled_tokens.data_ptr<int32_t>();
  const int32_t *sampled = sampled_token_ids.data_ptr<int32_t>(), *num = num_sampled.data_ptr<int32_t>();
  const int32_t* slot = idx_mapping.data_ptr<int32_t>();
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t s = slot[b], start = total[s];
    const int64_t n = std::max<int64_t>(0, std::min({int64_t(num[b]), width, len - start}));
    if (n == 0) continue;  // a mid-prefill chunk: the slot stays exactly as it was
    std::copy_n(sampled + b * width, n, table + s * len + start);
    total[s] = int32_t(start + n);
    last[s] = sampled[b * width + n - 1];
  }
}

}  // namespace

TORCH_LIBRARY(pdserve_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("qk_norm_rope(Tensor x, int num_q, Tensor q_weight, Tensor k_weight, float eps, Tensor cos, Tensor sin) "
        "-> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()");
  m.def("argmax(Tensor logits) -> Tensor");
  m.def("rejection_verify(Tensor logits, Tensor temperature, Tensor num_drafts, Tensor drafts, Tensor q, "
        "Tensor vocab_ids, Tensor accept_u, Tensor final_u) -> Tensor");
  m.def("gather_prefill_tokens(Tensor(a!) input_ids, Tensor all_token_ids, Tensor idx_mapping, "
        "Tensor query_start_loc, Tensor num_computed_tokens, Tensor is_prefilling) -> ()");
  m.def("combine_sampled_and_draft_tokens(Tensor(a!) input_ids, Tensor last_sampled_tokens, Tensor draft_tokens, "
        "Tensor num_draft_tokens, Tensor idx_mapping, Tensor query_start_loc, Tensor is_prefilling) -> ()");
  m.def("post_step_update(Tensor(a!) all_token_ids, Tensor(b!) total_len, Tensor(c!) last_sampled_tokens, "
        "Tensor sampled_token_ids, Tensor num_sampled, Tensor idx_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("write_kv", &write_kv);
  m.impl("argmax", &argmax);
  m.impl("rejection_verify", &rejection_verify);
  m.impl("gather_prefill_tokens", &gather_prefill_tokens);
  m.impl("combine_sampled_and_draft_tokens", &combine_sampled_and_draft_tokens);
  m.impl("post_step_update", &post_step_update);
}
