// Causal attention of a prompt over its own tokens on the CPU (a prefill with nothing cached before
// it), flash-attention style.
//
// torch's CPU flash kernel (what F.scaled_dot_product_attention runs) multiplies tiles of up to 256
// queries by 512 keys: on the diagonal a tile computes many scores the mask then discards, and each query
// head reads its KV head's keys and values again. Here a task is one KV head and a block of query
// positions, the queries of every head in its group stacked into one GEMM operand (the keys and values
// are read once for the group), keys in blocks no further than the block's last position: scores
// (Q K^T) and the weighted values (P V) are BLAS GEMMs (sgemm), an online softmax between them.
// The torch reference is F.scaled_dot_product_attention(is_causal=True, enable_gqa=True).
//
// q [T, H, D], k and v [T, H_kv, D], fp32, heads adjacent (stride D) and each vector contiguous; the
// rows (tokens) may be strided, as views of a fused QKV projection are. Built at first use by
// worker/cpu_attention.py.
#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include "vec_exp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// BLAS, from the library torch itself links (MKL on x86, OpenBLAS on ARM): column-major.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

// Query positions per task (times the group's heads: the GEMMs' rows) and keys per block: a task's
// operands (queries, scores, accumulators, one key and value block) stay within a core's L2.
constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 128;

// Row-major C[m x n] = A[m x k] * B' + beta * C, where B' is B^T for B given as [n x k]
// (`b_is_nk`), else B given as [k x n]. Column-major BLAS computes C^T = B'^T A^T.
inline void gemm(int m, int n, int k, const float* a, int lda, const float* b, int ldb, bool b_is_nk, float beta,
                 float* c, int ldc) {
  const float one = 1.f;
  const char ta = b_is_nk ? 'T' : 'N', tb = 'N';
  sgemm_(&ta, &tb, &n, &m, &k, &one, b, &ldb, a, &lda, &beta, c, &ldc);
}

inline float row_max(const float* s, int64_t n) {
  int64_t t = 0;
  float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(best);
  for (; t + 16 <= n; t += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(s + t));
  best = _mm512_reduce_max_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_set1_ps(best);
  for (; t + 8 <= n; t += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(s + t));
  best = reduce_max8(acc);
#endif
  for (; t < n; ++t) best = std::max(best, s[t]);
  return best;
}

// s[t] = exp(s[t] - top) for t < live, 0 for live <= t < n; returns the sum.
inline float exp_shifted(float* s, int64_t live, int64_t n, float top) {
  int64_t t = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(top);
  __m512 acc = _mm512_setzero_ps();
  for (; t + 16 <= live; t += 16) {
    const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
    _mm512_storeu_ps(s + t, p);
    acc = _mm512_add_ps(acc, p);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 shift = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= live; t += 8) {
    const __m256 p = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(s + t, p);
    acc = _mm256_add_ps(acc, p);
  }
  sum = reduce_add8(acc);
#endif
  for (; t < live; ++t) sum += (s[t] = std::exp(s[t] - top));
  std::fill(s + live, s + n, 0.f);
  return sum;
}

struct Scratch {
  std::vector<float> q, scores, acc, top, denom;
  explicit Scratch(int64_t rows, int64_t dim)
      : q(rows * dim), scores(rows * kKeyBlock), acc(rows * dim), top(rows), denom(rows) {}
};

struct Shapes {
  int64_t tokens, heads, kv_heads, dim, q_stride, k_stride, v_stride;
  float scale;
};

// Query positions [p0, p0 + kQueryBlock) of every head of KV head `kv_head`, over keys [0, p].
void attend_block(const float* q, const float* k, const float* v, float* out, int64_t kv_head, int64_t p0,
                  const Shapes& s, Scratch& w) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim;
  const int64_t p1 = std::min(s.tokens, p0 + kQueryBlock), rows = (p1 - p0) * group;
  // Row r is position p0 + r / group of head kv_head * group + r % group, scaled here once.
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + (p0 + r / group) * s.q_stride + (kv_head * group + r % group) * dim;
    float* dst = w.q.data() + r * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * s.scale;
  }
  std::fill(w.acc.begin(), w.acc.begin() + rows * dim, 0.f);
  std::fill(w.top.begin(), w.top.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(w.denom.begin(), w.denom.begin() + rows, 0.f);
  const float* k_head = k + kv_head * dim;
  const float* v_head = v + kv_head * dim;
  for (int64_t j0 = 0; j0 < p1; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, p1 - j0);
    gemm(rows, n, dim, w.q.data(), dim, k_head + j0 * s.k_stride, s.k_stride, true, 0.f, w.scores.data(), kKeyBlock);
    for (int64_t r = 0; r < rows; ++r) {
      float* sc = w.scores.data() + r * kKeyBlock;
      const int64_t live = std::clamp<int64_t>(p0 + r / group - j0 + 1, 0, n);  // keys j <= the row's position
      if (live == 0) {  // the whole block lies after this row's position
        std::fill(sc, sc + n, 0.f);
        continue;
      }
      const float top = std::max(w.top[r], row_max(sc, live));
      const float rescale = std::exp(w.top[r] - top);  // 0 on the row's first block
      w.denom[r] = w.denom[r] * rescale + exp_shifted(sc, live, n, top);
      w.top[r] = top;
      if (rescale != 1.f) {
        float* acc = w.acc.data() + r * dim;
        for (int64_t d = 0; d < dim; ++d) acc[d] *= rescale;
      }
    }
    gemm(rows, dim, n, w.scores.data(), kKeyBlock, v_head + j0 * s.v_stride, s.v_stride, false, 1.f, w.acc.data(), dim);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + ((p0 + r / group) * s.heads + kv_head * group + r % group) * dim;
    const float* acc = w.acc.data() + r * dim;
    const float inv = 1.f / w.denom[r];
    for (int64_t d = 0; d < dim; ++d) dst[d] = acc[d] * inv;
  }
}

void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q, k, v must be [T, heads, dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prefill_attention: fp32 only");
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && v.size(0) == tokens && v.size(1) == kv_heads && k.size(2) == dim &&
                  v.size(2) == dim && heads % kv_heads == 0,
              "prefill_attention: shapes do not match");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == dim, "prefill_attention: each token's heads must be contiguous");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes(),
              "prefill_attention: out must be a contiguous fp32 [T, heads, dim]");
  const Shapes s{tokens, heads, kv_heads, dim, q.stride(0), k.stride(0), v.stride(0), static_cast<float>(scale)};
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (tokens + kQueryBlock - 1) / kQueryBlock, tasks = blocks * kv_heads;
  const int64_t rows = kQueryBlock * (heads / kv_heads);
  // Later query blocks attend over more keys: handed out last block first, each to the next free
  // thread, so the cheap ones fill in at the end. BLAS inside the region runs on its calling thread.
#pragma omp parallel
  {
    Scratch w(rows, dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t block = blocks - 1 - task / kv_heads, kv_head = task % kv_heads;
      attend_block(qp, kp, vp, op, kv_head, block * kQueryBlock, s, w);
    }
  }
}

}  // namespace

TORCH_LIBRARY(pdserve_prefill, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_prefill, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
