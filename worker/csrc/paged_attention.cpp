// Paged attention on the CPU that reads the KV cache in place.
//
// Each task -- a request row and some of its KV heads -- walks the row's blocks through its block
// table and attends every query head of their groups over them: no dense copy of the context, no
// host-built mask.
// Row b owns queries [query_start[b], query_start[b] + query_len[b]) (a row with query_len 0 is
// skipped: the caller attends it another way); its seq_lens[b] keys include
// this step's tokens (already written to the cache), so query i sits at absolute position
// seq_len - query_len + i and sees keys j <= that position (and j > position - window when a
// sliding window is set). The torch reference is worker/attention.py:AttentionContext.attend.
//
// Arithmetic is fp32 whatever the cache dtype. Built at first use by worker/cpu_attention.py.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_exp.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

struct Shapes {
  int64_t heads, kv_heads, head_dim, block_size, max_blocks, window;
  int64_t q_stride_t, q_stride_h, kv_stride_slot, o_stride_t;
  float scale;
};

// Prefetch `bytes` from `p` into L2, a cache line at a time (locality 2: prefetcht1).
inline void prefetch_l2(const float* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, 2);
}

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += q[d] * static_cast<float>(k[d]);
  return acc;
}

// One (row, KV head) task, flash-decoding style: blocks of keys are visited once each, scores,
// an online softmax update and the V accumulation done while the block is hot in cache.
template <typename scalar_t>
void attend_row_head(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, scalar_t* out,
                     const int32_t* block_table, int64_t q0, int64_t q_len, int64_t seq_len, int64_t kv_head,
                     const Shapes& s) {
  const int64_t group = s.heads / s.kv_heads, dim = s.head_dim, bs = s.block_size;
  const int64_t rows = q_len * group;  // query vectors of this task: token-major, then head
  const int64_t first_pos = seq_len - q_len;
  const int64_t lo = s.window > 0 ? std::max<int64_t>(0, first_pos - s.window + 1) : 0;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> qf(rows * dim), acc(rows * dim, 0.f), max_score(rows, neg_inf), denom(rows, 0.f),
      scores(rows * bs);
  for (int64_t i = 0; i < q_len; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const scalar_t* src = q + (q0 + i) * s.q_stride_t + (kv_head * group + g) * s.q_stride_h;
      float* dst = qf.data() + (i * group + g) * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]) * s.scale;
    }
  for (int64_t blk = lo / bs; blk * bs < seq_len; ++blk) {
    const int64_t j0 = blk * bs, jlo = std::max(j0, lo), jhi = std::min(j0 + bs, seq_len);
    const int64_t slot0 = static_cast<int64_t>(block_table[blk]) * bs - j0;  // slot of key j: slot0 + j
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r / group;
      const float* qr = qf.data() + r * dim;
      float* sr = scores.data() + r * bs;
      float block_max = neg_inf;
      for (int64_t j = jlo; j < jhi; ++j) {
        const bool visible = j <= pos && (s.window <= 0 || j > pos - s.window);
        const float sc = visible ? dot(qr, k_cache + (slot0 + j) * s.kv_stride_slot + kv_head * dim, dim) : neg_inf;
        sr[j - jlo] = sc;
        block_max = std::max(block_max, sc);
      }
      if (block_max == neg_inf) continue;  // nothing of this block is visible to this query
      const float new_max = std::max(max_score[r], block_max);
      const float rescale = std::exp(max_score[r] - new_max);  // 0 on the first visible block
      float* a = acc.data() + r * dim;
      if (rescale != 1.f)
        for (int64_t d = 0; d < dim; ++d) a[d] *= rescale;
      const int64_t n = jhi - jlo;
      // One exp pass over the block's scores; masked keys come out as exactly 0.
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) sr[t] = std::exp(sr[t] - new_max);
      float sum = denom[r] * rescale;
      for (int64_t t = 0; t < n; ++t) sum += sr[t];
      for (int64_t t = 0; t < n; ++t) {
        const float p = sr[t];
        if (p == 0.f) continue;  // masked keys cost nothing more
        const scalar_t* v = v_cache + (slot0 + jlo + t) * s.kv_stride_slot + kv_head * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<float>(v[d]);
      }
      denom[r] = sum;
      max_score[r] = new_max;
    }
  }
  for (int64_t i = 0; i < q_len; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      scalar_t* dst = out + (q0 + i) * s.o_stride_t + (kv_head * group + g) * dim;
      const float inv = 1.f / denom[r];  // > 0: a query always sees itself
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[r * dim + d] * inv);
    }
}

// fp32 rows with head_dim 32, 64 or 128 walk the slots (attend_heads below) with the vector steps of
// Avx512Walk, or of Avx2Walk on CPUs without AVX-512. GCC's auto-vectorised generic path above
// (mostly 256-bit, a horizontal sum per key and a scalar expf call per score) is several times
// slower at decode and verify rows (benchmarks/bench_attention_kernel.py).

#if defined(__AVX512F__)
// The vector steps of the slot walk (attend_heads) in 512-bit registers, for head_dim DIM.
template <int DIM>
struct Avx512Walk {
  static constexpr int ND = DIM / 16;
  // scores[16 r] = q_r . k for n query rows q_r (DIM apart), the key held in registers for all.
  static void dots(const float* q, int64_t n, const float* k, float* scores) {
    __m512 kv[ND];
    for (int c = 0; c < ND; ++c) kv[c] = _mm512_loadu_ps(k + 16 * c);
    for (int64_t r = 0; r < n; ++r, q += DIM) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), kv[0]);
      for (int c = 1; c < ND; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), kv[c], a);
      scores[16 * r] = _mm512_reduce_add_ps(a);
    }
  }
  // A row's 16 scores of one chunk (keys [from, to) visible) become its weights; its running max and
  // denominator are updated and its accumulator rescaled.
  static void update(float* scores, int64_t from, int64_t to, float& max_score, float& denom, float* acc) {
    const __mmask16 visible = static_cast<__mmask16>(((1u << to) - 1) & ~((1u << from) - 1));
    const __m512 sc = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), visible, scores);
    const float new_max = std::max(max_score, _mm512_reduce_max_ps(sc));
    const float rescale = std::exp(max_score - new_max);  // 0 on the first visible chunk
    const __m512 p = exp_nonpositive(_mm512_sub_ps(sc, _mm512_set1_ps(new_max)));
    denom = denom * rescale + _mm512_reduce_add_ps(p);
    max_score = new_max;
    _mm512_storeu_ps(scores, p);
    const __m512 rs = _mm512_set1_ps(rescale);
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(acc + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), rs));
  }
  // acc_r += weights[16 r] * v for n rows' accumulators (DIM apart), the value held in registers.
  static void axpys(const float* weights, int64_t n, const float* v, float* acc) {
    __m512 vv[ND];
    for (int c = 0; c < ND; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
    for (int64_t r = 0; r < n; ++r, acc += DIM) {
      if (weights[16 * r] == 0.f) continue;  // masked keys cost nothing more
      const __m512 pv = _mm512_set1_ps(weights[16 * r]);
      for (int c = 0; c < ND; ++c) _mm512_storeu_ps(acc + 16 * c, _mm512_fmadd_ps(pv, vv[c], _mm512_loadu_ps(acc + 16 * c)));
    }
  }
};
#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
// The vector steps of the slot walk (attend_heads) in 256-bit registers, for head_dim DIM.
template <int DIM>
struct Avx2Walk {
  static constexpr int ND = DIM / 8;
  // As Avx512Walk::dots; a head's vector does not fit the 16 registers beside a row's sums, so each
  // row reads it from L1.
  static void dots(const float* q, int64_t n, const float* k, float* scores) {
    for (int64_t r = 0; r < n; ++r, q += DIM) {
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
      for (int c = 1; c < ND; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), a);
      scores[16 * r] = reduce_add8(a);
    }
  }
  // As Avx512Walk::update, the 16 scores in two halves.
  static void update(float* scores, int64_t from, int64_t to, float& max_score, float& denom, float* acc) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 sc[2];
    for (int half = 0; half < 2; ++half) {
      const __m256 at = _mm256_add_ps(lane, _mm256_set1_ps(8.f * half));
      const __m256 visible = _mm256_and_ps(_mm256_cmp_ps(at, _mm256_set1_ps(static_cast<float>(from)), _CMP_GE_OQ),
                                           _mm256_cmp_ps(at, _mm256_set1_ps(static_cast<float>(to)), _CMP_LT_OQ));
      sc[half] = _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                                  _mm256_loadu_ps(scores + 8 * half), visible);
    }
    const float new_max = std::max(max_score, reduce_max8(_mm256_max_ps(sc[0], sc[1])));
    const float rescale = std::exp(max_score - new_max);  // 0 on the first visible chunk
    float sum = 0.f;
    for (int half = 0; half < 2; ++half) {
      const __m256 p = exp_nonpositive_avx2(_mm256_sub_ps(sc[half], _mm256_set1_ps(new_max)));
      sum += reduce_add8(p);
      _mm256_storeu_ps(scores + 8 * half, p);
    }
    denom = denom * rescale + sum;
    max_score = new_max;
    const __m256 rs = _mm256_set1_ps(rescale);
    for (int c = 0; c < ND; ++c) _mm256_storeu_ps(acc + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), rs));
  }
  static void axpys(const float* weights, int64_t n, const float* v, float* acc) {
    for (int64_t r = 0; r < n; ++r, acc += DIM) {
      if (weights[16 * r] == 0.f) continue;  // masked keys cost nothing more
      const __m256 pv = _mm256_set1_ps(weights[16 * r]);
      for (int c = 0; c < ND; ++c)
        _mm256_storeu_ps(acc + 8 * c, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * c), _mm256_loadu_ps(acc + 8 * c)));
    }
  }
};

#endif  // __AVX2__ && __FMA__

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// KV heads [h0, h1) of one request row in fp32, with head_dim DIM and the vector steps of
// Walk<DIM> (Avx512Walk, Avx2Walk): every query row of those heads (the row's tokens times the heads
// sharing each KV head) walks the context a chunk of at most 16 contiguous slots at a time, so a
// verify row's tokens and the heads of a group read each key and value from memory once. A slot
// holds every KV head side by side, so one head's keys lie a slot apart: walked one head at a
// time, where a slot spans a page (a real-size model) every key is a miss that the hardware
// prefetcher, which follows a stream within a page, does not foresee, and where it does not (the
// bundled model) each head's walk still reads the chunk's lines again. Here a chunk's keys, then
// its values, are read slot by slot, every head of the slot in turn (an address stream in order),
// while the next chunk's slots are prefetched into L2; each query row keeps its scores, running
// max, denominator and output accumulator in memory between chunks (row r of head h, token i,
// group member g is ((h - h0) * q_len + i) * group + g).
template <template <int> class Walk, int DIM>
void attend_heads(const float* q, const float* k_cache, const float* v_cache, float* out, const int32_t* block_table,
                  int64_t q0, int64_t q_len, int64_t seq_len, int64_t h0, int64_t h1, const Shapes& s) {
  using W = Walk<DIM>;
  const int64_t group = s.heads / s.kv_heads, bs = s.block_size, stride = s.kv_stride_slot;
  const int64_t rows = (h1 - h0) * q_len * group, per_head = q_len * group;
  std::vector<float> qs(rows * DIM), acc(rows * DIM, 0.f), max_score(rows, -std::numeric_limits<float>::infinity()),
      denom(rows, 0.f), scores(rows * 16);
  std::vector<int64_t> from(q_len), to(q_len);
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t i = 0; i < q_len; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const float* src = q + (q0 + i) * s.q_stride_t + (h * group + g) * s.q_stride_h;
        float* dst = qs.data() + (((h - h0) * q_len + i) * group + g) * DIM;
        for (int64_t d = 0; d < DIM; ++d) dst[d] = src[d] * s.scale;
      }
  const int64_t first_pos = seq_len - q_len, last = seq_len - 1, span = (h1 - h0) * DIM * 4;
  auto lo_of = [&](int64_t pos) { return s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : int64_t{0}; };
  // Keys j .. j+n-1 of a chunk: contiguous slots of one block, the first at `slot`.
  auto chunk_at = [&](int64_t j, int64_t& slot) {
    const int64_t blk = j / bs, in_blk = j - blk * bs;
    slot = static_cast<int64_t>(block_table[blk]) * bs + in_blk;
    return std::min<int64_t>({16, bs - in_blk, last + 1 - j});
  };
  int64_t slot = 0, next_slot = 0;
  for (int64_t j = lo_of(first_pos), n = chunk_at(j, slot), next_n = 0; j <= last; j += n, n = next_n, slot = next_slot) {
    next_n = j + n <= last ? chunk_at(j + n, next_slot) : 0;
    for (int64_t i = 0; i < q_len; ++i)
      from[i] = std::max<int64_t>(lo_of(first_pos + i) - j, 0), to[i] = std::min<int64_t>(first_pos + i + 1 - j, n);
    // The chunk's slots of `cache` in order, every head of the task in each: use(t, h, the head's
    // vector in slot t), h counted from h0; the same slot of the next chunk is prefetched.
    auto walk = [&](const float* cache, auto&& use) {
      for (int64_t t = 0; t < n; ++t) {
        if (t < next_n) prefetch_l2(cache + (next_slot + t) * stride + h0 * DIM, span);
        for (int64_t h = 0; h < h1 - h0; ++h) use(t, h, cache + (slot + t) * stride + (h0 + h) * DIM);
      }
    };
    // Scores (the lanes a row does not see are masked by update), each row's softmax update, values.
    walk(k_cache, [&](int64_t t, int64_t h, const float* k) {
      W::dots(qs.data() + h * per_head * DIM, per_head, k, scores.data() + h * per_head * 16 + t);
    });
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = (r / group) % q_len;
      if (from[i] >= to[i]) {  // nothing of this chunk is visible to this token
        std::fill_n(scores.data() + r * 16, 16, 0.f);
        continue;
      }
      W::update(scores.data() + r * 16, from[i], to[i], max_score[r], denom[r], acc.data() + r * DIM);
    }
    walk(v_cache, [&](int64_t t, int64_t h, const float* v) {
      W::axpys(scores.data() + h * per_head * 16 + t, per_head, v, acc.data() + h * per_head * DIM);
    });
  }
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t i = 0; i < q_len; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = ((h - h0) * q_len + i) * group + g;
        float* dst = out + (q0 + i) * s.o_stride_t + (h * group + g) * DIM;
        const float inv = 1.f / denom[r];  // > 0: a query always sees itself
        for (int64_t d = 0; d < DIM; ++d) dst[d] = acc[r * DIM + d] * inv;
      }
}

// KV heads [h0, h1) of a request row through the slot walk; false where it does not apply.
template <template <int> class Walk, typename scalar_t>
bool attend_heads_if(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, scalar_t* out,
                     const int32_t* block_table, int64_t q0, int64_t q_len, int64_t seq_len, int64_t h0, int64_t h1,
                     const Shapes& s) {
  if constexpr (!std::is_same_v<scalar_t, float>) {
    return false;
  } else {
    switch (s.head_dim) {
      case 32: attend_heads<Walk, 32>(q, k_cache, v_cache, out, block_table, q0, q_len, seq_len, h0, h1, s); return true;
      case 64: attend_heads<Walk, 64>(q, k_cache, v_cache, out, block_table, q0, q_len, seq_len, h0, h1, s); return true;
      case 128: attend_heads<Walk, 128>(q, k_cache, v_cache, out, block_table, q0, q_len, seq_len, h0, h1, s); return true;
      default: return false;
    }
  }
}
#endif

// q: [T, H, D] (last dim contiguous); k_cache, v_cache: [slots, Hkv, D] contiguous; block_table:
// [B, max_blocks] int32; query_start, query_len, seq_lens: [B] int32; out: [T, H, D].
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_table, const at::Tensor& query_start, const at::Tensor& query_len,
                     const at::Tensor& seq_lens,
                     int64_t block_size, int64_t sliding_window, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && out.sizes() == q.sizes(), "paged_attention: bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() && q.stride(2) == 1,
              "paged_attention: caches and out must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && query_start.scalar_type() == at::kInt &&
                  query_len.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_table.is_contiguous(),
              "paged_attention: index tensors must be contiguous int32");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "paged_attention: q, cache and out dtypes differ");
  const int64_t num_rows = seq_lens.size(0);
  const Shapes s{q.size(1), k_cache.size(1), q.size(2), block_size, block_table.size(1), sliding_window,
                 q.stride(0), q.stride(1), k_cache.stride(0), out.stride(0), static_cast<float>(scale)};
  TORCH_CHECK(s.heads % s.kv_heads == 0, "paged_attention: heads must be a multiple of kv heads");
  const int32_t* q_start = query_start.data_ptr<int32_t>();
  const int32_t* q_lens = query_len.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // A task is a request row's KV heads [h0, h1): on the vector paths (attend_heads) as many heads as
    // leave each thread two tasks, one head on the generic one.
    bool vector_path = false;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    vector_path = q.scalar_type() == at::kFloat && (s.head_dim == 32 || s.head_dim == 64 || s.head_dim == 128);
#endif
    const int64_t splits =
        vector_path
            ? std::clamp<int64_t>((2 * at::get_num_threads() + num_rows - 1) / std::max<int64_t>(num_rows, 1), 1,
                                  s.kv_heads)
            : s.kv_heads;
    at::parallel_for(0, num_rows * splits, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / splits, part = task % splits;
        const int64_t h0 = s.kv_heads * part / splits, h1 = s.kv_heads * (part + 1) / splits;
        const int64_t q0 = q_start[b], q_len = q_lens[b];
        if (q_len == 0) continue;
        const int32_t* table = bt + b * s.max_blocks;
#if defined(__AVX512F__)
        if (vector_path && attend_heads_if<Avx512Walk>(qp, kp, vp, op, table, q0, q_len, lens[b], h0, h1, s)) continue;
#elif defined(__AVX2__) && defined(__FMA__)
        if (vector_path && attend_heads_if<Avx2Walk>(qp, kp, vp, op, table, q0, q_len, lens[b], h0, h1, s)) continue;
#endif
        for (int64_t h = h0; h < h1; ++h) {
          attend_row_head(qp, kp, vp, op, table, q0, q_len, lens[b], h, s);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor query_start, "
      "Tensor query_len, Tensor seq_lens, int block_size, int sliding_window, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
