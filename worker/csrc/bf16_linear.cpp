// The MTP drafter's kernels on a CPU, for a float32 target: its weights are stored in bfloat16 and
// every product and sum is fp32 (worker/models/linear.py, worker/models/mtp.py).
//
// linear_bf16w: y = x @ w^T (+ bias) for a few fp32 input rows against a bf16 weight. A decode or
// draft step multiplies a handful of rows by every weight of the layer, and those weights come from
// memory each step (L3 or DRAM, bandwidth-bound on one core), so half the bytes is most of the time.
// On a CPU with native bf16 math oneDNN's bf16 GEMM is no better at these sizes: it converts the input
// and pays a fixed cost a call (benchmarks/results/bf16_linear.txt). bf16 -> fp32 is exact (the top 16
// bits), so every product is the fp32 product of the rounded weight; the sums are fp32 in another
// order than MKL's.
//
// mtp_layer: the whole MTP layer (norms, input_proj, the decoder block with its paged attention,
// final norm) in one call for a step's few rows. In Python the layer is ~40 torch ops whose
// dispatch cost more than their arithmetic at a few rows; drafts need no
// bit-exactness (the target verifies them), only speed.
//
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "skinny_linear.h"

namespace {

using skinny::BF16;

// y[M, N] = x[M, K] @ w[N, K]^T (+ bias), w in bf16.
void linear_into(const float* xp, int64_t M, int64_t K, const uint16_t* wp, int64_t N, const float* b, float* yp) {
  skinny::linear<BF16>(xp, M, K, wp, nullptr, b, yp, N);
}

at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) == x.size(1),
              "weight must be a contiguous [out, in] bfloat16 CPU tensor matching x's columns");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == weight.size(0),
                "bias must be a contiguous float32 tensor of the weight's rows");
    b = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  linear_into(x.data_ptr<float>(), M, K, reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), N, b,
              y.data_ptr<float>());
  return y;
}


// ---------------------------------------------------------------- the fused MTP layer

const uint16_t* bf16_weight(const at::Tensor& w, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 2 && w.size(0) == rows &&
                  w.size(1) == cols,
              "mtp_layer: ", name, " must be a contiguous [", rows, ", ", cols, "] bfloat16 weight");
  return reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
}

const float* fp32_vector(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n,
              "mtp_layer: ", name, " must be a contiguous float32 tensor of ", n, " elements");
  return t.data_ptr<float>();
}

const float* optional_bias(const c10::optional<at::Tensor>& b, int64_t n, const char* name) {
  return b.has_value() && b->defined() ? fp32_vector(*b, n, name) : nullptr;
}

// dst = src * rsqrt(mean(src^2) + eps) * w over n elements.
void rms_norm_row(const float* src, const float* w, float* dst, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += src[i] * src[i];
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale * w[i];
}

// x [d] rotated in place as transformers' rotate-half RoPE; cs: cos then sin, d each.
void rope_row(float* x, const float* cs, int64_t d) {
  const int64_t half = d / 2;
  const float* c = cs;
  const float* s = cs + d;
  for (int64_t k = 0; k < half; ++k) {
    const float a = x[k], b = x[k + half];
    x[k] = a * c[k] - b * s[k];
    x[k + half] = b * c[k + half] + a * s[k + half];
  }
}

using PagedAttention = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, double,
                            at::Tensor&);

// One projection of the layer: the bf16 weight (fp32 arithmetic) for inputs of at most
// `bf16_max_rows` rows, else the GEMM weight (where a bigger input is a GEMM that computes, not a
// weight read), where the layer has it: fp32 through MKL, or, on a CPU with native bf16 math, the
// bf16 weight itself through oneDNN, the input rounded to bf16 (faster than fp32 at these row counts
// with AMX, benchmarks/results/bf16_linear.txt; drafts need no exactness, the target verifies them).
struct Projection {
  const at::Tensor& bf16;
  const at::Tensor& gemm;  // undefined or empty where the layer keeps only the bf16 weight
  const float* bias;
  c10::optional<at::Tensor> bias_tensor;

  at::Tensor operator()(const at::Tensor& x, int64_t bf16_max_rows) const {
    const int64_t M = x.size(0), K = x.size(1), N = bf16.size(0);
    if (M > bf16_max_rows && gemm.defined() && gemm.numel()) {
      if (gemm.scalar_type() == at::kFloat) return at::linear(x, gemm, bias_tensor);
      at::Tensor y = at::linear(x.to(at::kBFloat16), gemm).to(at::kFloat);
      return bias_tensor ? y.add_(*bias_tensor) : y;
    }
    at::Tensor y = at::empty({M, N}, x.options());
    linear_into(x.data_ptr<float>(), M, K, reinterpret_cast<const uint16_t*>(bf16.data_ptr<at::BFloat16>()), N, bias,
                y.data_ptr<float>());
    return y;
  }
};

// hidden [T, H]: the target's final hidden states h_i; input_ids [T] int32: x_{i+1}; positions [T]
// int64. Rows of the step (block_table [R, max_blocks], query_start / query_len / seq_lens [R] int32)
// own consecutive tokens. norms: hidden_layernorm, token_layernorm, input_layernorm,
// post_attention_layernorm, final_layernorm[, q_norm, k_norm]; weights (bf16) and gemm_weights (fp32
// or bf16, see Projection, or empty tensors): input_proj, qkv_proj, o_proj, gate_up_proj, down_proj,
// with their optional fp32 biases. Writes the layer's K/V into k_cache / v_cache ([slots, kv_heads,
// head_dim]) and returns the final-normed hidden states [T, H].
at::Tensor mtp_layer(const at::Tensor& hidden, const at::Tensor& input_ids, const at::Tensor& positions,
                     const at::Tensor& embed, const at::Tensor& cos_sin, at::TensorList norms, at::TensorList weights,
                     at::TensorList gemm_weights, const c10::List<c10::optional<at::Tensor>>& biases,
                     const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& query_start, const at::Tensor& query_len, const at::Tensor& seq_lens,
                     int64_t block_size, int64_t sliding_window, int64_t num_heads, double eps_d, bool zero_position0,
                     int64_t bf16_max_rows) {
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.is_contiguous(),
              "mtp_layer: hidden must be a contiguous [tokens, hidden] float32 tensor");
  const int64_t T = hidden.size(0), H = hidden.size(1);
  TORCH_CHECK(input_ids.scalar_type() == at::kInt && input_ids.numel() == T && input_ids.is_contiguous(),
              "mtp_layer: input_ids must be int32, one per token");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T && positions.is_contiguous(),
              "mtp_layer: positions must be int64, one per token");
  TORCH_CHECK(embed.scalar_type() == at::kFloat && embed.dim() == 2 && embed.size(1) == H && embed.is_contiguous(),
              "mtp_layer: embed must be a contiguous [vocab, hidden] float32 tensor");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && k_cache.dim() == 3 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() && v_cache.scalar_type() == at::kFloat,
              "mtp_layer: the caches must be contiguous [slots, kv_heads, head_dim] float32 tensors");
  const int64_t nkv = k_cache.size(1), D = k_cache.size(2), nh = num_heads, Q = nh * D, KV = nkv * D;
  TORCH_CHECK(norms.size() == 5 || norms.size() == 7, "mtp_layer: 5 norms, or 7 with q_norm and k_norm");
  TORCH_CHECK(weights.size() == 5 && gemm_weights.size() == 5 && biases.size() == 5,
              "mtp_layer: 5 weights, 5 GEMM weights (or empty tensors) and 5 (optional) biases");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.dim() == 4 &&
                  cos_sin.size(1) == 2 && cos_sin.size(3) == D,
              "mtp_layer: cos_sin must be the [positions, 2, 1, head_dim] float32 table");
  const int64_t I = weights[3].size(0) / 2;  // intermediate size
  const int64_t in_features[5] = {2 * H, H, Q, H, I}, out_features[5] = {H, Q + 2 * KV, H, 2 * I, H};
  const char* names[5] = {"input_proj", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
  std::vector<Projection> proj;
  for (int i = 0; i < 5; ++i) {
    bf16_weight(weights[i], out_features[i], in_features[i], names[i]);
    const at::Tensor& wg = gemm_weights[i];
    TORCH_CHECK(!wg.defined() || !wg.numel() ||
                    ((wg.scalar_type() == at::kFloat || wg.scalar_type() == at::kBFloat16) &&
                     wg.sizes() == weights[i].sizes()),
                "mtp_layer: the GEMM ", names[i], " weight (fp32 or bf16) must match its bf16 one");
    const c10::optional<at::Tensor> b = biases.get(i);
    proj.push_back(Projection{weights[i], wg, optional_bias(b, out_features[i], names[i]), b});
  }
  const float* n_hidden = fp32_vector(norms[0], H, "hidden_layernorm");
  const float* n_token = fp32_vector(norms[1], H, "token_layernorm");
  const float* n_input = fp32_vector(norms[2], H, "input_layernorm");
  const float* n_post = fp32_vector(norms[3], H, "post_attention_layernorm");
  const float* n_final = fp32_vector(norms[4], H, "final_layernorm");
  const float* n_q = norms.size() == 7 ? fp32_vector(norms[5], D, "q_norm") : nullptr;
  const float* n_k = norms.size() == 7 ? fp32_vector(norms[6], D, "k_norm") : nullptr;
  const int64_t R = seq_lens.numel(), max_blocks = block_table.size(1), max_pos = cos_sin.size(0);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.size(0) == R &&
                  query_start.scalar_type() == at::kInt && query_len.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && query_start.numel() == R && query_len.numel() == R,
              "mtp_layer: block_table [rows, max_blocks] and query_start / query_len / seq_lens [rows], all int32");
  const float eps = static_cast<float>(eps_d);
  const int32_t* ids = input_ids.data_ptr<int32_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* ql = query_len.data_ptr<int32_t>();
  const int64_t vocab = embed.size(0), num_slots = k_cache.size(0);
  const auto norm_rows = [&](const at::Tensor& src, const float* w) {
    at::Tensor dst = at::empty({T, H}, hidden.options());
    for (int64_t t = 0; t < T; ++t) rms_norm_row(src.data_ptr<float>() + t * H, w, dst.data_ptr<float>() + t * H, H, eps);
    return dst;
  };

  // 1. input_proj(cat[hidden_layernorm(h), token_layernorm(embed(x))]), the embedding zeroed at position 0.
  at::Tensor cat = at::empty({T, 2 * H}, hidden.options());
  float* catp = cat.data_ptr<float>();
  const float* hp = hidden.data_ptr<float>();
  const float* ep = embed.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "mtp_layer: token id ", ids[t], " out of range");
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "mtp_layer: position ", pos[t], " out of range");
    rms_norm_row(hp + t * H, n_hidden, catp + t * 2 * H, H, eps);
    if (zero_position0 && pos[t] == 0) {
      std::fill(catp + t * 2 * H + H, catp + (t + 1) * 2 * H, 0.f);
    } else {
      rms_norm_row(ep + static_cast<int64_t>(ids[t]) * H, n_token, catp + t * 2 * H + H, H, eps);
    }
  }
  at::Tensor x = proj[0](cat, bf16_max_rows);

  // 2. Attention: q/k/v, RoPE, K/V into the cache, the paged kernel, o_proj, residual.
  at::Tensor qkv = proj[1](norm_rows(x, n_input), bf16_max_rows);
  float* qkvp = qkv.data_ptr<float>();
  at::Tensor q = at::empty({T, nh, D}, hidden.options());
  float* qp = q.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t = qs[r]; t < qs[r] + ql[r]; ++t) {
      TORCH_CHECK(t < T && pos[t] / block_size < max_blocks, "mtp_layer: token ", t, " outside the step's layout");
      const int64_t slot = static_cast<int64_t>(bt[r * max_blocks + pos[t] / block_size]) * block_size + pos[t] % block_size;
      TORCH_CHECK(slot >= 0 && slot < num_slots, "mtp_layer: cache slot ", slot, " out of range");
      const float* cs = cos_sin.data_ptr<float>() + pos[t] * 2 * D;
      float* row = qkvp + t * (Q + 2 * KV);
      for (int64_t h = 0; h < nh + nkv; ++h) {
        float* head = row + h * D;
        if (n_q != nullptr) rms_norm_row(head, h < nh ? n_q : n_k, head, D, eps);
        rope_row(head, cs, D);
      }
      std::copy(row, row + Q, qp + t * Q);
      std::copy(row + Q, row + Q + KV, kc + slot * KV);
      std::copy(row + Q + KV, row + Q + 2 * KV, vc + slot * KV);
    }
  }
  at::Tensor attn = at::empty({T, nh, D}, hidden.options());
  static auto paged = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("pdserve_cpu::paged_attention", "")
                          .typed<PagedAttention>();
  paged.call(q, k_cache, v_cache, block_table, query_start, query_len, seq_lens, block_size, sliding_window,
             1.0 / std::sqrt(static_cast<double>(D)), attn);
  x.add_(proj[2](attn.view({T, Q}), bf16_max_rows));

  // 3. MLP: down(silu(gate) * up), residual.
  at::Tensor gu = proj[3](norm_rows(x, n_post), bf16_max_rows);
  at::Tensor act = at::empty({T, I}, hidden.options());
  const float* gup = gu.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gup + t * 2 * I;
    for (int64_t i = 0; i < I; ++i) actp[t * I + i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
  }
  x.add_(proj[4](act, bf16_max_rows));

  // 4. final_layernorm.
  return norm_rows(x, n_final);
}


// Non-finite logits, as everywhere a token is picked (worker/fused_ops.py): NaN counts as -inf,
// +inf as the largest float; so a draft is always a token of the draft vocabulary.
float finite(float x) {
  return x != x ? -std::numeric_limits<float>::infinity() : std::min(x, std::numeric_limits<float>::max());
}

// One independently drawn draft (DraftMode.INDEPENDENT): q = softmax(row * inv_temp) over the draft
// vocabulary, written to `q`, and a draw from it by inverse CDF with the uniform `u` (one uniform a
// draft: the exponential race takes two logarithms a token). A row with no finite logit has no
// distribution: q is then a point mass at column 0, which is the draft (the rejection sampler is
// exact for a deterministic draft whose q is its point mass).
int64_t independent_draft(const float* row, int64_t Vd, float inv_temp, float u, float* q) {
  float peak = -std::numeric_limits<float>::infinity(), sum = 0.f;
  for (int64_t v = 0; v < Vd; ++v) peak = std::max(peak, finite(row[v] * inv_temp));
  if (peak == -std::numeric_limits<float>::infinity()) {
    std::fill(q, q + Vd, 0.f);
    q[0] = 1.f;
    return 0;
  }
  for (int64_t v = 0; v < Vd; ++v) sum += (q[v] = std::exp(finite(row[v] * inv_temp) - peak));
  const float target = u * sum;
  float below = 0.f;
  int64_t best = 0;  // (the peak's q is 1: some token has mass)
  for (int64_t v = 0; v < Vd; ++v) {
    if (q[v] > 0.f) best = v;  // (a target rounded up to the sum takes the last token of mass)
    if ((below += q[v]) > target && best == v) break;
  }
  for (int64_t v = 0; v < Vd; ++v) q[v] /= sum;
  return best;
}

// Drafts [R, k] (int32): draft 0 is the argmax of the draft head over `hidden` [R, H] (each
// row's MTP hidden state at its last position, `last_pos`); draft i > 0 runs the layer once more at
// position last_pos + i over (the previous hidden state, draft i - 1), one token per row, and takes
// the argmax of its head. `head` [Vd, H] bf16 (head_gemm: its GEMM weight, see Projection, or empty)
// scores the draft vocabulary, whose token ids are `vocab_ids` (int64 [Vd]; empty: the whole vocabulary).
// In Python each draft is ~10 torch ops and an attention context built on the host.
//
// With `noise` [R, k, V] (uniforms, V the whole vocabulary) the drafts are sampled instead, coupled
// with the verifier (DraftMode.COUPLED): draft i of row r is the exponential race the sampler runs
// for that output position with the very same uniforms, over softmax(logits * inv_temp[r]) --
// argmax_v p_v / E_v with E = -log1p(-U), computed as logit * inv_temp - log E (the softmax's
// normaliser does not change the argmax).
//
// With `draft_probs` [R, k, Vd] non-empty as well, the drafts are drawn independently instead
// (DraftMode.INDEPENDENT): `noise` is then [R, k, 1], one fresh uniform a draft, which picks the
// draft from q = softmax(logits * inv_temp) over the draft vocabulary by inverse CDF, and
// draft_probs receives each q for the rejection sampler (zero outside the draft vocabulary).
//
// With `pass_ids` non-empty, `hidden` is instead the target's hidden states of the step's kept
// positions (row r: pass_len[r] of them, ending at last_pos[r], consecutive rows back to back), and
// the layer first runs over them (the MTP pass of a steady decode step, x_{i+1} = pass_ids); draft 0
// then comes from each row's last one.
at::Tensor mtp_draft(const at::Tensor& hidden, const at::Tensor& pass_ids, const at::Tensor& pass_len,
                       const at::Tensor& last_pos, int64_t k, const at::Tensor& head,
                       const at::Tensor& head_gemm, const at::Tensor& vocab_ids, const at::Tensor& noise,
                       const at::Tensor& inv_temp, const at::Tensor& draft_probs, const at::Tensor& embed,
                       const at::Tensor& cos_sin, at::TensorList norms, at::TensorList weights,
                       at::TensorList gemm_weights, const c10::List<c10::optional<at::Tensor>>& biases,
                       const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                       int64_t block_size, int64_t sliding_window, int64_t num_heads, double eps,
                       int64_t bf16_max_rows) {
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.is_contiguous(),
              "mtp_draft: hidden must be a contiguous [tokens, hidden] float32 tensor");
  const int64_t R = last_pos.numel(), H = hidden.size(1), Vd = head.size(0);
  TORCH_CHECK(k >= 1, "mtp_draft: k must be >= 1");
  TORCH_CHECK(last_pos.scalar_type() == at::kLong && last_pos.numel() == R && last_pos.is_contiguous(),
              "mtp_draft: last_pos must be int64, one per row");
  bf16_weight(head, Vd, H, "head");
  TORCH_CHECK(!vocab_ids.numel() || (vocab_ids.scalar_type() == at::kLong && vocab_ids.numel() == Vd &&
                                     vocab_ids.is_contiguous()),
              "mtp_draft: vocab_ids must be empty or the int64 token id of each head row");
  const Projection score{head, head_gemm, nullptr, c10::nullopt};
  const bool sampled = noise.numel() > 0;
  const bool independent = draft_probs.numel() > 0;
  const int64_t V = sampled ? noise.size(2) : 0;
  TORCH_CHECK(!sampled || (noise.scalar_type() == at::kFloat && noise.is_contiguous() && noise.dim() == 3 &&
                           noise.size(0) == R && noise.size(1) == k && inv_temp.scalar_type() == at::kFloat &&
                           inv_temp.numel() == R && (independent || vocab_ids.numel() || V == Vd)),
              "mtp_draft: noise must be [rows, k, vocab] float32 uniforms with inv_temp [rows] float32");
  TORCH_CHECK(!independent || (sampled && V == 1 && draft_probs.scalar_type() == at::kFloat &&
                               draft_probs.is_contiguous() && draft_probs.numel() == R * k * Vd),
              "mtp_draft: draft_probs must be [rows, k, draft vocab] float32, with noise [rows, k, 1]");
  float* q_out = independent ? draft_probs.data_ptr<float>() : nullptr;
  const float* un = sampled ? noise.data_ptr<float>() : nullptr;
  const float* it = sampled ? inv_temp.data_ptr<float>() : nullptr;
  at::Tensor tokens = at::empty({R, k}, last_pos.options().dtype(at::kInt));
  int32_t* out = tokens.data_ptr<int32_t>();
  const int64_t* ids = vocab_ids.numel() ? vocab_ids.data_ptr<int64_t>() : nullptr;
  at::Tensor h = hidden;
  at::Tensor seq_lens = at::empty({R}, tokens.options());
  if (pass_ids.numel()) {
    TORCH_CHECK(pass_len.scalar_type() == at::kInt && pass_len.numel() == R && pass_len.is_contiguous() &&
                    pass_ids.scalar_type() == at::kInt && pass_ids.numel() == hidden.size(0),
                "mtp_draft: pass_len (int32, per row) and pass_ids (int32, per token) must match hidden");
    const int32_t* lens = pass_len.data_ptr<int32_t>();
    at::Tensor starts = at::empty({R}, tokens.options());
    at::Tensor pass_pos = at::empty({hidden.size(0)}, last_pos.options());
    at::Tensor ends = at::empty({R}, last_pos.options());
    int64_t t = 0;
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(lens[r] >= 1, "mtp_draft: every row passes at least one position");
      starts.data_ptr<int32_t>()[r] = static_cast<int32_t>(t);
      const int64_t end = last_pos.data_ptr<int64_t>()[r];
      seq_lens.data_ptr<int32_t>()[r] = static_cast<int32_t>(end + 1);
      for (int64_t j = 0; j < lens[r]; ++j) pass_pos.data_ptr<int64_t>()[t + j] = end - lens[r] + 1 + j;
      t += lens[r];
      ends.data_ptr<int64_t>()[r] = t - 1;
    }
    TORCH_CHECK(t == hidden.size(0), "mtp_draft: pass_len must add up to hidden's tokens");
    h = mtp_layer(hidden, pass_ids, pass_pos, embed, cos_sin, norms, weights, gemm_weights, biases, k_cache, v_cache,
                  block_table, starts, pass_len, seq_lens, block_size, sliding_window, num_heads, eps, true,
                  bf16_max_rows)
                .index_select(0, ends);
  }
  TORCH_CHECK(h.size(0) == R, "mtp_draft: one hidden state per row (or pass_ids)");
  at::Tensor step_ids = at::empty({R}, tokens.options());
  at::Tensor positions = at::empty({R}, last_pos.options());
  at::Tensor query_start = at::arange(R, tokens.options());
  at::Tensor query_len = at::ones({R}, tokens.options());
  for (int64_t i = 0; i < k; ++i) {
    if (i > 0) {
      for (int64_t r = 0; r < R; ++r) {
        step_ids.data_ptr<int32_t>()[r] = out[r * k + i - 1];
        positions.data_ptr<int64_t>()[r] = last_pos.data_ptr<int64_t>()[r] + i;
        seq_lens.data_ptr<int32_t>()[r] = static_cast<int32_t>(last_pos.data_ptr<int64_t>()[r] + i + 1);
      }
      h = mtp_layer(h, step_ids, positions, embed, cos_sin, norms, weights, gemm_weights, biases, k_cache, v_cache,
                    block_table, query_start, query_len, seq_lens, block_size, sliding_window, num_heads, eps, false,
                    bf16_max_rows);
    }
    const at::Tensor logits = score(h, bf16_max_rows);
    const float* lp = logits.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) {
      const float* row = lp + r * Vd;
      int64_t best = 0;
      if (independent) {
        best = independent_draft(row, Vd, it[r], un[r * k + i], q_out + (r * k + i) * Vd);
      } else if (sampled) {
        const float* u = un + (r * k + i) * V;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t v = 0; v < Vd; ++v) {
          const int64_t id = ids ? ids[v] : v;
          const float e = std::max(-std::log1p(-u[id]), std::numeric_limits<float>::min());
          const float score = row[v] * it[r] - std::log(e);
          if (score > top) top = score, best = v;
        }
      } else {  // the first of equal maxima (NaN as -inf: a NaN never compares greater)
        for (int64_t v = 1; v < Vd; ++v) best = finite(row[v]) > finite(row[best]) ? v : best;
      }
      out[r * k + i] = static_cast<int32_t>(ids ? ids[best] : best);
    }
  }
  return tokens;
}

}  // namespace

TORCH_LIBRARY(pdserve_bf16, m) {
  m.def("linear_bf16w(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "mtp_layer(Tensor hidden, Tensor input_ids, Tensor positions, Tensor embed, Tensor cos_sin, Tensor[] norms, "
      "Tensor[] weights, Tensor[] gemm_weights, Tensor?[] biases, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor block_table, Tensor query_start, Tensor query_len, Tensor seq_lens, int block_size, int sliding_window, "
      "int num_heads, float eps, bool zero_position0, int bf16_max_rows) -> Tensor");
  m.def(
      "mtp_draft(Tensor hidden, Tensor pass_ids, Tensor pass_len, Tensor last_pos, int k, Tensor head, "
      "Tensor head_gemm, Tensor vocab_ids, Tensor noise, Tensor inv_temp, Tensor(c!) draft_probs, "
      "Tensor embed, Tensor cos_sin, Tensor[] norms, Tensor[] weights, Tensor[] gemm_weights, Tensor?[] biases, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, int block_size, int sliding_window, "
      "int num_heads, float eps, int bf16_max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_bf16, CPU, m) {
  m.impl("linear_bf16w", &linear_bf16w);
  m.impl("mtp_layer", &mtp_layer);
  m.impl("mtp_draft", &mtp_draft);
}
