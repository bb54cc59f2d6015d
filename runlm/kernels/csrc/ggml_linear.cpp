// torch wrappers of the linear layers and lookups on GGUF weights as stored (ggml_linear_impl.h
// holds the code, its kernels and why results never depend on the batch).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <ggml-cpu.h>
#include <ggml.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ggml_linear_impl.h"

namespace {

namespace gl = runlm::ggml_linear;

void check_segment(const at::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(gl::supported(type), "ggml type ", type, " has no CPU dot product");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "weights must be a contiguous CPU uint8 [N, row_bytes] tensor");
  const std::string bad = gl::check_segment(type, k, w.size(1));
  TORCH_CHECK(bad.empty(), bad);
}

at::Tensor linear_impl(const at::Tensor& x_in, const std::vector<at::Tensor>& weights,
                       const std::vector<int64_t>& types, const std::optional<at::Tensor>& bias, bool vec_dot_only) {
  TORCH_CHECK(weights.size() == types.size() && !weights.empty(), "one type per weight segment");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "x must be fp32 on the CPU");
  const at::Tensor x = x_in.contiguous();
  const int64_t k = x.size(-1);
  const int64_t m = x.numel() / std::max<int64_t>(k, 1);
  std::vector<gl::Segment> segs;
  for (size_t s = 0; s < weights.size(); ++s) {
    check_segment(weights[s], types[s], k);
    segs.push_back({weights[s].data_ptr<uint8_t>(), weights[s].size(0), weights[s].size(1), types[s]});
  }
  gl::Plan plan;
  const std::string bad = gl::make_plan(std::move(segs), k, vec_dot_only, plan);
  TORCH_CHECK(bad.empty(), bad);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = plan.col0.back();
  at::Tensor y = at::empty(out_shape, x.options());
  const bool has_bias = bias.has_value() && bias->defined();
  // an fp32 bias of N values is added in the kernel's loop, any other the torch way (the same sum)
  const bool own_bias = has_bias && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->device().is_cpu() && bias->numel() == plan.col0.back();
  gl::Scratch scratch;
  gl::linear(x.data_ptr<float>(), m, plan, own_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), scratch);
  if (has_bias && !own_bias) y.add_(*bias);
  return y;
}

at::Tensor linear(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& types,
                  const std::optional<at::Tensor>& bias) {
  return linear_impl(x, weights, types, bias, false);
}

// ggml's vec_dot for every type, our block kernels bypassed: the benchmark's comparison.
at::Tensor linear_vec_dot(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& types) {
  return linear_impl(x, weights, types, std::nullopt, true);
}

// Rows `ids` of a [V, row_bytes] table, dequantized: the embedding lookup of a quantized table.
at::Tensor embedding(const at::Tensor& ids_in, const at::Tensor& table, int64_t type, int64_t k) {
  check_segment(table, type, k);
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t t = ids.numel();
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  const std::string bad = gl::check_ids(ids.data_ptr<int64_t>(), t, table.size(0));
  TORCH_CHECK(bad.empty(), bad);
  gl::embedding(ids.data_ptr<int64_t>(), t, table.data_ptr<uint8_t>(), table.size(1), type, k, out.data_ptr<float>());
  return out;
}

// The whole [N, row_bytes] table as fp32 [N, K] (exact mode, and tests).
at::Tensor dequantize(const at::Tensor& table, int64_t type, int64_t k) {
  check_segment(table, type, k);
  at::Tensor out = at::empty({table.size(0), k}, at::TensorOptions().dtype(at::kFloat));
  gl::dequantize(table.data_ptr<uint8_t>(), table.size(0), table.size(1), type, k, out.data_ptr<float>());
  return out;
}

// fp32 [N, K] -> raw [N, row_bytes] in ggml type `type` (ggml's reference quantizer, no imatrix):
// writes GGUF-shaped weights for tests and benchmarks.
at::Tensor quantize(const at::Tensor& w_in, int64_t type) {
  const ggml_type t = static_cast<ggml_type>(type);
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat, "w must be fp32 [N, K]");
  TORCH_CHECK(!ggml_quantize_requires_imatrix(t), ggml_type_name(t), " needs an importance matrix");
  const at::Tensor w = w_in.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % ggml_blck_size(t) == 0, "K=", k, " is not a whole number of ", ggml_type_name(t), " blocks");
  at::Tensor out = at::empty({n, gl::row_bytes(type, k)}, at::TensorOptions().dtype(at::kByte));
  ggml_quantize_chunk(t, w.data_ptr<float>(), out.data_ptr<uint8_t>(), 0, n, k, nullptr);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  ggml_cpu_init();  // fp16 tables and the CPU feature probe the dot products rely on
  m.def("linear", &linear, "x [..., K] fp32 @ concat(weights)^T (+ bias) -> [..., N]", pybind11::arg("x"),
        pybind11::arg("weights"), pybind11::arg("types"), pybind11::arg("bias") = std::nullopt);
  m.def("linear_vec_dot", &linear_vec_dot, "linear through ggml's vec_dot for every type (for comparison)");
  m.def("embedding", &embedding, "rows ids of a quantized table, dequantized to fp32");
  m.def("dequantize", &dequantize, "a whole quantized [N, row_bytes] table to fp32 [N, K]");
  m.def("quantize", &quantize, "fp32 [N, K] to a raw [N, row_bytes] table of a ggml type");
  m.def("supported", &gl::supported, "whether ggml has a CPU dot product for this type");
  m.def("block_size", &gl::block_size, "values per block of this type");
  m.def("row_bytes", &gl::row_bytes, "bytes of one row of K values of this type");
  m.def("cpu_features", &gl::cpu_features, "the SIMD features ggml's CPU backend uses");
}
