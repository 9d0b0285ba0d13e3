// Causal attention of a prompt over its own tokens on the CPU (a prefill with nothing cached before
// it), flash-attention style.
//
// torch's CPU flash kernel (what F.scaled_dot_product_attention runs) multiplies tiles of up to 256
// queries by 512 keys: on the diagonal a tile computes many scores the mask then discards, and each query
// head reads its KV head's keys and values again. Here a task is one KV head and a block of query
// positions, the queries of every head in its group stacked into one operand (the keys and values
// are read once for the group), keys in blocks no further than the block's last position: scores
// (Q K^T), an online softmax, and the weighted values (P V).
// The torch reference is F.scaled_dot_product_attention(is_causal=True, enable_gqa=True).
//
// q [T, H, D], k and v [T, H_kv, D], fp32, heads adjacent (stride D) and each vector contiguous; the
// rows (tokens) may be strided, as views of a fused QKV projection are. Built at first use by
// worker/cpu_attention.py.
#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include "panel_linear.h"
#include "vec_exp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Query positions per task (times the group's heads: the GEMMs' rows) and keys per block: a task's
// operands (queries, scores, accumulators, one key and value block) stay within a core's L2.
constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 128;

struct Shapes {
  int64_t tokens, heads, kv_heads, dim, q_stride, k_stride, v_stride;
  float scale;
};

#ifdef PDSERVE_PANEL_SIMD
// With AVX2 or AVX-512 the two products run in the panel kernel's form (panel_linear.h): a tile of R
// rows times one P-wide panel, each step one load of the panel's P values and R broadcasts, 2 * R
// accumulators. BLAS (which this kernel called before) copies its operands into its own layout on
// every call, and MKL takes its AVX2 path on AMD's AVX-512 CPUs (benchmarks/results/attention_kernel.txt);
// here the operands are kept in the tile's layout from the start.
// Everything is transposed: a task's query rows are the panels' columns, so scores, probabilities
// and accumulators are [key or dim][row] and the online softmax runs down columns, lanes apart,
// with no horizontal sums.
using panel::LANES;
using panel::P;
using panel::ROWS;
using panel::Vec;

// y[i][:] (+)= sum_k x[k][i] * w[k][:] for i < R: x R values a step ([K][R]), w one panel ([K][P]),
// y rows P apart.
template <int R>
void tile(const float* x, const float* w, int64_t K, float* y, bool accumulate) {
  Vec acc[R][2];
  for (int i = 0; i < R; ++i) {
    acc[i][0] = accumulate ? panel::load(y + i * P) : panel::zero();
    acc[i][1] = accumulate ? panel::load(y + i * P + LANES) : panel::zero();
  }
  for (int64_t k = 0; k < K; ++k) {
    const Vec a = panel::load(w + k * P), b = panel::load(w + k * P + LANES);
    for (int i = 0; i < R; ++i) {
      const Vec xv = panel::broadcast(x[k * R + i]);
      acc[i][0] = panel::fma(xv, a, acc[i][0]);
      acc[i][1] = panel::fma(xv, b, acc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    panel::store(y + i * P, acc[i][0]);
    panel::store(y + i * P + LANES, acc[i][1]);
  }
}

// A last group of rem < ROWS rows: R counts down to rem.
template <int R>
void tile_tail(int rem, const float* x, const float* w, int64_t K, float* y, bool accumulate) {
  if (rem == R) {
    tile<R>(x, w, K, y, accumulate);
  } else if constexpr (R > 1) {
    tile_tail<R - 1>(rem, x, w, K, y, accumulate);
  }
}

// Rows [0, M) of y (+)= x w, x packed by `pack` in groups of ROWS rows.
void tiles(int64_t M, const float* x, const float* w, int64_t K, float* y, bool accumulate) {
  int64_t i = 0;
  for (; i + ROWS <= M; i += ROWS) tile<ROWS>(x + i * K, w, K, y + i * P, accumulate);
  if (i < M) tile_tail<ROWS - 1>(static_cast<int>(M - i), x + i * K, w, K, y + i * P, accumulate);
}

// dst = src [M rows `row_stride` apart][K] in groups of ROWS rows, each group [K][its rows]: the rows a
// tile broadcasts, read front to back (keys and values are rows of the fused QKV projection, far
// apart: read in place, a tile's rows would also share a cache set).
void pack(const float* src, int64_t row_stride, int64_t M, int64_t K, float* dst) {
  for (int64_t i0 = 0; i0 < M; i0 += ROWS) {
    const int64_t R = std::min<int64_t>(ROWS, M - i0);
    float* g = dst + i0 * K;
    for (int64_t i = 0; i < R; ++i)
      for (int64_t k = 0; k < K; ++k) g[k * R + i] = src[(i0 + i) * row_stride + k];
  }
}

// Lane-wise max and exp (x <= 0); +, - and * are the vector types' own operators (GCC, Clang).
#if defined(__AVX512F__)
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vexp(Vec x) { return exp_nonpositive(x); }
#else
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vexp(Vec x) { return exp_nonpositive_avx2(x); }
#endif

// Every KV head's keys and values, each block of kKeyBlock positions packed as the tiles read it: keys
// in groups of ROWS keys ([dim][ROWS]), values in groups of ROWS dims ([keys][ROWS]). Packed once a
// call, in parallel: every query block from a key block on reads it again.
struct KeyValues {
  int64_t blocks, block_floats;
  float *keys, *values;  // [kv_heads][blocks][block_floats]
  std::vector<float> owned;  // their storage when larger than a thread keeps (kKeptFloats)
  const float* key_block(int64_t kv_head, int64_t j0) const {
    return keys + (kv_head * blocks + j0 / kKeyBlock) * block_floats;
  }
  const float* value_block(int64_t kv_head, int64_t j0) const {
    return values + (kv_head * blocks + j0 / kKeyBlock) * block_floats;
  }
};

// The packed keys and values a calling thread keeps between calls (each layer of a prefill needs the
// same size, and fresh pages would be faulted in and zeroed by the kernel on every call): 64 MiB,
// a 2048-token chunk of 8 KV heads of 128 with room to spare. Longer prompts get storage of their
// own, freed at the end of the call.
constexpr int64_t kKeptFloats = int64_t{16} << 20;

KeyValues key_values(const float* k, const float* v, const Shapes& s) {
  const int64_t blocks = (s.tokens + kKeyBlock - 1) / kKeyBlock, size = kKeyBlock * s.dim, dim = s.dim;
  const int64_t floats = s.kv_heads * blocks * size;
  thread_local std::vector<float> kept;
  KeyValues kv{blocks, size, nullptr, nullptr, {}};
  std::vector<float>& storage = 2 * floats <= kKeptFloats ? kept : kv.owned;
  if (static_cast<int64_t>(storage.size()) < 2 * floats) storage.resize(2 * floats);
  kv.keys = storage.data();
  kv.values = storage.data() + floats;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < s.kv_heads * blocks; ++t) {
    const int64_t h = t / blocks, j0 = t % blocks * kKeyBlock, n = std::min(kKeyBlock, s.tokens - j0);
    pack(k + j0 * s.k_stride + h * dim, s.k_stride, n, dim, kv.keys + t * size);
    float* values = kv.values + t * size;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d0 = 0; d0 < dim; d0 += ROWS) {
        const int64_t R = std::min<int64_t>(ROWS, dim - d0);
        const float* src = v + (j0 + j) * s.v_stride + h * dim + d0;
        for (int64_t i = 0; i < R; ++i) values[d0 * n + j * R + i] = src[i];
      }
  }
  return kv;
}

// A task's operands, per panel of P rows: queries [dim][P], scores then probabilities
// [kKeyBlock][P], accumulators [dim][P]; the running max and sum per row.
struct Scratch {
  std::vector<float> q, scores, acc, top, denom;
  Scratch(int64_t panels, int64_t dim)
      : q(panels * dim * P), scores(panels * kKeyBlock * P), acc(panels * dim * P), top(panels * P),
        denom(panels * P) {}
};

// Query positions [p0, p0 + kQueryBlock) of every head of KV head `kv_head`, over keys [0, p].
void attend_block(const float* q, const KeyValues& kv, float* out, int64_t kv_head, int64_t p0, const Shapes& s,
                  Scratch& w) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim;
  const int64_t p1 = std::min(s.tokens, p0 + kQueryBlock), rows = (p1 - p0) * group;
  const int64_t panels = (rows + P - 1) / P;
  // Row r is position p0 + r / group of head kv_head * group + r % group, scaled here once; rows past
  // the last fill their panel with zeros (their results are never written out).
  const auto position = [&](int64_t r) { return std::min(p1 - 1, p0 + r / group); };
  if (rows % P) std::fill(w.q.begin() + (panels - 1) * dim * P, w.q.begin() + panels * dim * P, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + (p0 + r / group) * s.q_stride + (kv_head * group + r % group) * dim;
    float* dst = w.q.data() + (r / P) * dim * P + r % P;
    for (int64_t d = 0; d < dim; ++d) dst[d * P] = src[d] * s.scale;
  }
  std::fill(w.acc.begin(), w.acc.begin() + panels * dim * P, 0.f);
  std::fill(w.top.begin(), w.top.begin() + panels * P, -std::numeric_limits<float>::infinity());
  std::fill(w.denom.begin(), w.denom.begin() + panels * P, 0.f);
  // Every row's position is at least p0, and key blocks start at multiples of kKeyBlock no later
  // than p1 - 1 <= p0 + kQueryBlock - 1 with kQueryBlock <= kKeyBlock: so each block holds a live
  // key for every row, and the running max is finite from the first block on.
  static_assert(kQueryBlock <= kKeyBlock && kKeyBlock % kQueryBlock == 0);
  for (int64_t j0 = 0; j0 < p1; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, s.tokens - j0);  // the packed block's keys, some maybe past p1 - 1
    const float* keys = kv.key_block(kv_head, j0);
    const float* values = kv.value_block(kv_head, j0);
    for (int64_t pn = 0; pn < panels; ++pn) {
      // Keys past the panel's last position are masked for all its rows: not computed, but in whole
      // packed groups of ROWS (the masking below takes the rest).
      const int64_t last = position(pn * P + P - 1);
      const int64_t live = std::min(n, (last - j0 + 1 + ROWS - 1) / ROWS * ROWS);
      float* sc = w.scores.data() + pn * kKeyBlock * P;
      tiles(live, keys, w.q.data() + pn * dim * P, dim, sc, false);  // sc[j][c] = k[j0 + j] . q[c]
      if (j0 + live - 1 > position(pn * P)) {  // keys after some row's position
        for (int64_t c = 0; c < P; ++c)
          for (int64_t j = position(pn * P + c) - j0 + 1; j < live; ++j)
            sc[j * P + c] = -std::numeric_limits<float>::infinity();
      }
      float* top = w.top.data() + pn * P;
      float* denom = w.denom.data() + pn * P;
      float* acc = w.acc.data() + pn * dim * P;
      for (int64_t c = 0; c < P; c += LANES) {
        Vec best = panel::load(top + c);
        for (int64_t j = 0; j < live; ++j) best = vmax(best, panel::load(sc + j * P + c));
        const Vec rescale = vexp(panel::load(top + c) - best);  // 0 on the first block
        Vec sum = panel::zero();
        for (int64_t j = 0; j < live; ++j) {
          const Vec p = vexp(panel::load(sc + j * P + c) - best);
          panel::store(sc + j * P + c, p);
          sum = sum + p;
        }
        panel::store(denom + c, panel::load(denom + c) * rescale + sum);
        panel::store(top + c, best);
        for (int64_t d = 0; d < dim; ++d) panel::store(acc + d * P + c, panel::load(acc + d * P + c) * rescale);
      }
      // acc[d][c] += sum_j v[j0 + j][d] * p[j][c], the values grouped by dim with n keys a group
      for (int64_t d0 = 0; d0 < dim; d0 += ROWS) {
        const int64_t R = std::min<int64_t>(ROWS, dim - d0);
        const float* x = values + d0 * n;
        if (R == ROWS) {
          tile<ROWS>(x, sc, live, acc + d0 * P, true);
        } else {
          tile_tail<ROWS - 1>(static_cast<int>(R), x, sc, live, acc + d0 * P, true);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + ((p0 + r / group) * s.heads + kv_head * group + r % group) * dim;
    const float* acc = w.acc.data() + (r / P) * dim * P + r % P;
    const float inv = 1.f / w.denom[r];
    for (int64_t d = 0; d < dim; ++d) dst[d] = acc[d * P] * inv;
  }
}

Scratch make_scratch(int64_t rows, int64_t dim) { return Scratch((rows + P - 1) / P, dim); }

#else
// Without AVX2 (ARM, older x86): the products are BLAS GEMMs, from the library torch itself links (MKL
// on x86, OpenBLAS on ARM), column-major.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

// Row-major C[m x n] = A[m x k] * B' + beta * C, where B' is B^T for B given as [n x k]
// (`b_is_nk`), else B given as [k x n]. Column-major BLAS computes C^T = B'^T A^T.
inline void gemm(int m, int n, int k, const float* a, int lda, const float* b, int ldb, bool b_is_nk, float beta,
                 float* c, int ldc) {
  const float one = 1.f;
  const char ta = b_is_nk ? 'T' : 'N', tb = 'N';
  sgemm_(&ta, &tb, &n, &m, &k, &one, b, &ldb, a, &lda, &beta, c, &ldc);
}

inline float row_max(const float* s, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) best = std::max(best, s[t]);
  return best;
}

// s[t] = exp(s[t] - top) for t < live, 0 for live <= t < n; returns the sum.
inline float exp_shifted(float* s, int64_t live, int64_t n, float top) {
  float sum = 0.f;
  for (int64_t t = 0; t < live; ++t) sum += (s[t] = std::exp(s[t] - top));
  std::fill(s + live, s + n, 0.f);
  return sum;
}

struct Scratch {
  std::vector<float> q, scores, acc, top, denom;
  explicit Scratch(int64_t rows, int64_t dim)
      : q(rows * dim), scores(rows * kKeyBlock), acc(rows * dim), top(rows), denom(rows) {}
};

// Keys and values read in place.
struct KeyValues {
  const float *k, *v;
};

KeyValues key_values(const float* k, const float* v, const Shapes&) { return {k, v}; }

// Query positions [p0, p0 + kQueryBlock) of every head of KV head `kv_head`, over keys [0, p].
void attend_block(const float* q, const KeyValues& kv, float* out, int64_t kv_head, int64_t p0, const Shapes& s,
                  Scratch& w) {
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
  const float* k_head = kv.k + kv_head * dim;
  const float* v_head = kv.v + kv_head * dim;
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

Scratch make_scratch(int64_t rows, int64_t dim) { return Scratch(rows, dim); }
#endif

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
  float* op = out.data_ptr<float>();
  const KeyValues kv = key_values(k.data_ptr<float>(), v.data_ptr<float>(), s);
  const int64_t blocks = (tokens + kQueryBlock - 1) / kQueryBlock, tasks = blocks * kv_heads;
  const int64_t rows = kQueryBlock * (heads / kv_heads);
  // Later query blocks attend over more keys: handed out last block first, each to the next free
  // thread, so the cheap ones fill in at the end. BLAS inside the region runs on its calling thread.
#pragma omp parallel
  {
    Scratch w = make_scratch(rows, dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t block = blocks - 1 - task / kv_heads, kv_head = task % kv_heads;
      attend_block(qp, kv, op, kv_head, block * kQueryBlock, s, w);
    }
  }
}

}  // namespace

TORCH_LIBRARY(pdserve_prefill, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_prefill, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
