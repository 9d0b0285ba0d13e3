// The linears of a decode step for weights stored as fp32 (panel_linear.h) or int8 (skinny_linear.h).
//
// linear_f32w: an fp32 weight in panels (panel_width() output features each). For a few rows MKL's
// and oneDNN's fp32 GEMMs read the weight well below the rate the cores stream memory
// (benchmarks/results/quantization.md); which of the three runs a given weight shape and row count
// is measured per machine (worker/models/linear.py, tune_linears).
//
// linear_int8w: int8 weights with one fp32 scale per output feature (weight-only, per-channel
// symmetric: --quantization int8). Why a kernel of ours: torch's own weight-only int8 op
// (aten::_weight_int8pack_mm) has a vectorised CPU path only for bf16 activations; with fp32 ones it
// runs a scalar loop, and torchao's int8 weight-only tensor dequantizes the whole weight on every
// call in eager mode. oneDNN's int8 matmuls in torch quantize the activation too, which changes the
// arithmetic (benchmarks/results/quantization.md).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "panel_linear.h"
#include "skinny_linear.h"

namespace {

const float* checked_input(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D float32 CPU tensor");
  return x.data_ptr<float>();
}

const float* checked_per_feature(const c10::optional<at::Tensor>& t, int64_t N, const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N, what,
              " must be a contiguous float32 tensor of the weight's rows");
  return t->data_ptr<float>();
}

void check_weight(const at::Tensor& x, const at::Tensor& weight, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == dtype && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) == x.size(1),
              "weight must be a contiguous [out, in] ", what, " CPU tensor matching x's columns");
}

int64_t panel_width() { return panel::P; }

at::Tensor linear_f32w(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
  const float* xp = checked_input(x);
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.dim() == 3 && panels.size(0) == (N + panel::P - 1) / panel::P && panels.size(1) == K &&
                  panels.size(2) == panel::P,
              "panels must be a contiguous [ceil(out / P), in, P] float32 CPU tensor, P = panel_width()");
  const float* b = checked_per_feature(bias, N, "bias");
  at::Tensor y = at::empty({M, N}, x.options());
  panel::linear(xp, M, K, panels.data_ptr<float>(), b, y.data_ptr<float>(), N);
  return y;
}

at::Tensor linear_int8w(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& bias) {
  const float* xp = checked_input(x);
  check_weight(x, weight, at::kChar, "int8");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* s = checked_per_feature(scale, N, "scale");
  const float* b = checked_per_feature(bias, N, "bias");
  at::Tensor y = at::empty({M, N}, x.options());
  skinny::linear<skinny::Int8>(xp, M, K, weight.data_ptr<int8_t>(), s, b, y.data_ptr<float>(), N);
  return y;
}

}  // namespace

TORCH_LIBRARY(pdserve_linear, m) {
  m.def("panel_width() -> int", &panel_width);
  m.def("linear_f32w(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor");
  m.def("linear_int8w(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_linear, CPU, m) {
  m.impl("linear_f32w", &linear_f32w);
  m.impl("linear_int8w", &linear_int8w);
}
