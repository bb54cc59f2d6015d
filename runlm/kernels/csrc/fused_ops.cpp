// torch wrappers of the fused per-layer ops (fused_ops_impl.h holds the code and says what each does).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <vector>

#include "fused_ops_impl.h"

namespace {

namespace fused = runlm::fused;

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              " must be a contiguous fp32 CPU tensor");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(w, "weight");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  TORCH_CHECK(w.numel() == n, "norm weight has ", w.numel(), " values for rows of ", n);
  at::Tensor out = at::empty(x.sizes(), x.options());
  fused::rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), rows, n, static_cast<float>(eps));
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_rows(w, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  TORCH_CHECK(w.numel() == n, "norm weight has ", w.numel(), " values for rows of ", n);
  at::Tensor out = at::empty(x.sizes(), x.options());
  fused::add_rms_norm(x.data_ptr<float>(), residual.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(),
                      rows, n, static_cast<float>(eps));
  return out;
}

template <void (*Op)(const float*, float*, int64_t, int64_t)>
at::Tensor gated(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t two_i = gate_up.size(-1), inner = two_i / 2, rows = gate_up.numel() / std::max<int64_t>(two_i, 1);
  TORCH_CHECK(two_i % 2 == 0, "gate_up must have an even number of columns");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inner;
  at::Tensor out = at::empty(shape, gate_up.options());
  Op(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inner);
  return out;
}

at::Tensor qkv_rope_store(const at::Tensor& qkv, const at::Tensor& positions_in, const at::Tensor& cos,
                          const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots_in,
                          int64_t heads, int64_t kv_heads, int64_t d, bool interleaved,
                          const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps) {
  for (const at::Tensor* t : {&qkv, &cos, &sin, static_cast<const at::Tensor*>(&k_cache), static_cast<const at::Tensor*>(&v_cache)})
    check_rows(*t, "qkv, rope tables and caches");
  const int64_t t = qkv.size(0), width = (heads + 2 * kv_heads) * d;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width, "qkv must be [T, (H + 2 KVH) * D]");
  TORCH_CHECK(cos.size(1) == d && sin.sizes() == cos.sizes(), "rope tables must be [positions, D]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == kv_heads && k_cache.size(2) == d &&
              v_cache.sizes() == k_cache.sizes(), "caches must be [slots, KVH, D]");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(positions.numel() == t && slots.numel() == t, "one position and one cache slot per row");
  const fused::QkvShape shape{t, heads, kv_heads, d, cos.size(0), k_cache.size(0), interleaved};
  const int64_t *pos = positions.data_ptr<int64_t>(), *sl = slots.data_ptr<int64_t>();
  const std::string bad = fused::check_qkv_rows(shape, pos, sl);
  TORCH_CHECK(bad.empty(), bad);
  const float* qn = q_norm.has_value() && q_norm->defined() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() && k_norm->defined() ? k_norm->data_ptr<float>() : nullptr;
  at::Tensor q = at::empty({t, heads, d}, qkv.options());
  fused::qkv_rope_store(qkv.data_ptr<float>(), pos, cos.data_ptr<float>(), sin.data_ptr<float>(),
                        k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sl, shape, qn, kn,
                        static_cast<float>(eps), q.data_ptr<float>());
  return q;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &gated<runlm::fused::silu_mul>);
  m.def("gelu_tanh_mul", &gated<runlm::fused::gelu_tanh_mul>);
  m.def("qkv_rope_store", &qkv_rope_store);
}
