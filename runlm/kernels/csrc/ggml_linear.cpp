// Linear layers and embedding lookups on GGUF weights as stored, through ggml's CPU type traits.
//
// A weight is one or more "segments": a raw [N_i, row_bytes] uint8 view of the mapped file in
// its own ggml block type (Q4_K, Q6_K, Q8_0, F16, IQ4_XS, ...). Outputs of the segments are
// concatenated, so q/k/v or gate/up stay separate tensors in the file (no copy) yet run as one
// call. Each row of x is quantized once per activation type the segments ask for (Q8_0, Q8_1,
// Q8_K, F16, ...: the type's `vec_dot_type`), then every output is one `vec_dot` of a weight
// row with a quantized x row: llama.cpp's own numerics and SIMD kernels (the prebuilt
// libggml-cpu picks AVX2 / AVX-512 / VNNI code at load time).
//
// The 32-value block types (Q8_0, Q4_0, Q5_0, Q4_1, Q5_1) and the K-quants Q4_K, Q5_K, Q6_K go
// through our own kernels instead (block_gemm.h, kquant_gemm.h: 8 weight rows unpacked once per
// block and multiplied into every activation row, the 8 results in 8 SIMD lanes: no horizontal
// sums; prefill is compute-bound). bench/quant_gemm_bench.py compares them with vec_dot.
//
// Batch invariance: y[m, n] depends only on x row m and weight row n (one pair's dot product),
// never on M, on the tile a row lands in, or on the thread count; threads split N only.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <ggml-cpu.h>
#include <ggml.h>

#include "block_gemm.h"
#include "kquant_gemm.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace {

// Weight rows a thread keeps hot in L1/L2 while every x row passes over them (prefill).
constexpr int64_t kRowTile = 16;
// Below this many weight bytes a call stays on one thread: fork/join would cost more.
constexpr int64_t kMinBytesPerThread = 32 * 1024;

const ggml_type_traits_cpu* cpu_traits(int64_t type) {
  return ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
}

bool supported(int64_t type) {
  if (type < 0 || type >= GGML_TYPE_COUNT) return false;
  const ggml_type t = static_cast<ggml_type>(type);
  const auto* tr = cpu_traits(t);
  if (tr == nullptr || tr->vec_dot == nullptr || ggml_get_type_traits(t)->to_float == nullptr) return false;
  if (ggml_blck_size(t) <= 0 || ggml_get_type_traits(t)->blck_size == 0) return false;
  const ggml_type vt = tr->vec_dot_type;
  return vt == GGML_TYPE_F32 || cpu_traits(vt)->from_float != nullptr;
}

int64_t row_bytes(int64_t type, int64_t k) { return static_cast<int64_t>(ggml_row_size(static_cast<ggml_type>(type), k)); }

void check_segment(const at::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(supported(type), "ggml type ", type, " has no CPU dot product");
  TORCH_CHECK(k % ggml_blck_size(static_cast<ggml_type>(type)) == 0, "K=", k, " is not a whole number of ",
              ggml_type_name(static_cast<ggml_type>(type)), " blocks");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "weights must be a contiguous CPU uint8 [N, row_bytes] tensor");
  TORCH_CHECK(w.size(1) == row_bytes(type, k), "row of ", w.size(1), " bytes, but ", ggml_type_name(static_cast<ggml_type>(type)),
              " needs ", row_bytes(type, k), " for K=", k);
}

// x rows quantized to one activation type: row m at data + m * stride.
struct QuantizedRows {
  ggml_type type;
  std::vector<uint8_t> buf;
  const uint8_t* data = nullptr;
  int64_t stride = 0;
  std::vector<int32_t> block_sums;  // Q8_0/Q8_1 rows: each block's sum of values, [m][k / 32]
};

// Our kernel for a weight type, if it has one: rows [n0, n1) of one segment; and whether it reads
// the activation blocks' sums (types stored with an offset or a min: its own traits say).
using BlockRows = void (*)(const uint8_t*, int64_t, const uint8_t*, int64_t, const int32_t*, int64_t, int64_t,
                           float*, int64_t, int64_t, int64_t, const uint8_t*);
struct OurKernel {
  BlockRows rows = nullptr;
  bool block_sums = false;
};

template <class W>
OurKernel block_type() {
  return {blockgemm::rows<W>, W::kOffset != 0 || W::kMin};
}

template <class W>
OurKernel kquant_type() {
  return {kquant::rows<W>, false};  // Q8_K rows carry their own group sums
}

OurKernel our_kernel(int64_t type) {
  switch (type) {
    case GGML_TYPE_Q8_0: return block_type<blockgemm::Q8_0>();
    case GGML_TYPE_Q4_0: return block_type<blockgemm::Q4_0>();
    case GGML_TYPE_Q5_0: return block_type<blockgemm::Q5_0>();
    case GGML_TYPE_Q4_1: return block_type<blockgemm::Q4_1>();
    case GGML_TYPE_Q5_1: return block_type<blockgemm::Q5_1>();
    case GGML_TYPE_Q4_K: return kquant_type<kquant::Q4_K>();
    case GGML_TYPE_Q5_K: return kquant_type<kquant::Q5_K>();
    case GGML_TYPE_Q6_K: return kquant_type<kquant::Q6_K>();
    default: return {};
  }
}

template <class X>
void block_sums_of(QuantizedRows& q, int64_t m, int64_t nb) {
  for (int64_t i = 0; i < m; ++i) {
    const auto* blocks = reinterpret_cast<const X*>(q.data + i * q.stride);
    for (int64_t b = 0; b < nb; ++b) q.block_sums[i * nb + b] = blockgemm::block_sum(blocks[b].qs);
  }
}

// Each x block's sum of values (Q8_0 or Q8_1 rows).
void compute_block_sums(QuantizedRows& q, int64_t m, int64_t k) {
  const int64_t nb = k / blockgemm::QK;
  q.block_sums.resize(static_cast<size_t>(m * nb));
  if (q.type == GGML_TYPE_Q8_1)
    block_sums_of<blockgemm::BlockQ8_1>(q, m, nb);
  else
    block_sums_of<blockgemm::BlockQ8_0>(q, m, nb);
}

void quantize_rows(const float* x, int64_t m, int64_t k, ggml_type type, QuantizedRows& out) {
  out.type = type;
  if (type == GGML_TYPE_F32) {  // F32 weights take x as it is
    out.data = reinterpret_cast<const uint8_t*>(x);
    out.stride = k * static_cast<int64_t>(sizeof(float));
    return;
  }
  out.stride = row_bytes(type, k);
  out.buf.resize(static_cast<size_t>(out.stride * m));
  const auto from_float = cpu_traits(type)->from_float;
  uint8_t* dst = out.buf.data();
  const int64_t stride = out.stride;
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) from_float(x + i * k, dst + i * stride, k);
  });
  out.data = out.buf.data();
}

// y[:, col0 : col0 + N_seg] for one segment, rows [n0, n1) of it.
void segment_rows(const uint8_t* w, int64_t wstride, ggml_vec_dot_t dot, const QuantizedRows& xq, int64_t m, int64_t k,
                  float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t t0 = n0; t0 < n1; t0 += kRowTile) {
    const int64_t t1 = std::min(n1, t0 + kRowTile);
    for (int64_t i = 0; i < m; ++i) {
      const uint8_t* xr = xq.data + i * xq.stride;
      float* yr = y + i * ldy;
      for (int64_t n = t0; n < t1; ++n) dot(static_cast<int>(k), yr + n, 0, w + n * wstride, 0, xr, 0, 1);
    }
  }
}

at::Tensor linear_impl(const at::Tensor& x_in, const std::vector<at::Tensor>& weights,
                       const std::vector<int64_t>& types, const std::optional<at::Tensor>& bias, bool vec_dot_only) {
  TORCH_CHECK(weights.size() == types.size() && !weights.empty(), "one type per weight segment");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "x must be fp32 on the CPU");
  const at::Tensor x = x_in.contiguous();
  const int64_t k = x.size(-1);
  const int64_t m = x.numel() / std::max<int64_t>(k, 1);
  std::vector<int64_t> col0(weights.size() + 1, 0);
  int64_t wbytes = 0;
  for (size_t s = 0; s < weights.size(); ++s) {
    check_segment(weights[s], types[s], k);
    col0[s + 1] = col0[s] + weights[s].size(0);
    wbytes += weights[s].numel();
  }
  const int64_t n = col0.back();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, x.options());
  if (m == 0) return y;

  // one quantized copy of x per activation type the segments need (usually one, Q8_K + Q8_0 at most)
  std::vector<QuantizedRows> qx;
  std::vector<int> seg_q(weights.size());
  for (size_t s = 0; s < weights.size(); ++s) {
    const ggml_type vt = cpu_traits(types[s])->vec_dot_type;
    auto it = std::find_if(qx.begin(), qx.end(), [&](const QuantizedRows& q) { return q.type == vt; });
    if (it == qx.end()) {
      qx.emplace_back();
      quantize_rows(x.data_ptr<float>(), m, k, vt, qx.back());
      it = qx.end() - 1;
    }
    seg_q[s] = static_cast<int>(it - qx.begin());
  }

  std::vector<OurKernel> ours(weights.size());  // none at all when the benchmark asks for vec_dot only
  for (size_t s = 0; s < weights.size(); ++s) {
    if (!vec_dot_only) ours[s] = our_kernel(types[s]);
    if (ours[s].block_sums && qx[seg_q[s]].block_sums.empty()) compute_block_sums(qx[seg_q[s]], m, k);
  }

  // Work items: panels of 8 rows of one segment (our kernel's unit) or kRowTile rows (vec_dot's).
  struct Item { int seg; int64_t lo, hi; };
  std::vector<Item> items;
  std::vector<std::vector<uint8_t>> zero_rows(weights.size());
  for (size_t s = 0; s < weights.size(); ++s) {
    const int64_t rows = weights[s].size(0);
    const int64_t step = ours[s].rows != nullptr ? blockgemm::kPanel : kRowTile;
    if (ours[s].rows != nullptr) zero_rows[s].assign(static_cast<size_t>(weights[s].size(1)), 0);
    for (int64_t r = 0; r < rows; r += step) items.push_back({static_cast<int>(s), r, std::min(rows, r + step)});
  }
  float* yp = y.data_ptr<float>();
  const int64_t bytes_per_item = std::max<int64_t>(1, wbytes / static_cast<int64_t>(items.size()));
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / (bytes_per_item * m));
  at::parallel_for(0, static_cast<int64_t>(items.size()), grain, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const Item& item = items[it];
      const int s = item.seg;
      // neighbouring items of one segment run as one call: the kernel then streams their rows in order
      int64_t hi = item.hi;
      while (it + 1 < e && items[it + 1].seg == s) hi = items[++it].hi;
      const auto& w = weights[s];
      const QuantizedRows& xq = qx[seg_q[s]];
      const uint8_t* wp = w.data_ptr<uint8_t>();
      if (const BlockRows kernel = ours[s].rows)
        kernel(wp, w.size(1), xq.data, xq.stride, xq.block_sums.empty() ? nullptr : xq.block_sums.data(), m,
               k / ggml_blck_size(static_cast<ggml_type>(types[s])), yp + col0[s], n, item.lo, hi, zero_rows[s].data());
      else
        segment_rows(wp, w.size(1), cpu_traits(types[s])->vec_dot, xq, m, k, yp + col0[s], n, item.lo, hi);
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
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
  const int64_t t = ids.numel(), v = table.size(0);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  const auto to_float = ggml_get_type_traits(static_cast<ggml_type>(type))->to_float;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < v, "token id ", id[i], " is outside the vocabulary of ", v);
  const uint8_t* base = table.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t stride = table.size(1);
  for (int64_t i = 0; i < t; ++i) to_float(base + id[i] * stride, o + i * k, k);
  return out;
}

// The whole [N, row_bytes] table as fp32 [N, K] (exact mode, and tests).
at::Tensor dequantize(const at::Tensor& table, int64_t type, int64_t k) {
  check_segment(table, type, k);
  at::Tensor out = at::empty({table.size(0), k}, at::TensorOptions().dtype(at::kFloat));
  const auto to_float = ggml_get_type_traits(static_cast<ggml_type>(type))->to_float;
  const uint8_t* base = table.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t stride = table.size(1);
  at::parallel_for(0, table.size(0), 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) to_float(base + i * stride, o + i * k, k);
  });
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
  at::Tensor out = at::empty({n, row_bytes(type, k)}, at::TensorOptions().dtype(at::kByte));
  ggml_quantize_chunk(t, w.data_ptr<float>(), out.data_ptr<uint8_t>(), 0, n, k, nullptr);
  return out;
}

std::string cpu_features() {
  std::string s;
  const std::pair<const char*, int> flags[] = {
      {"AVX", ggml_cpu_has_avx()},           {"AVX2", ggml_cpu_has_avx2()},
      {"FMA", ggml_cpu_has_fma()},           {"F16C", ggml_cpu_has_f16c()},
      {"AVX_VNNI", ggml_cpu_has_avx_vnni()}, {"AVX512", ggml_cpu_has_avx512()},
      {"AVX512_VNNI", ggml_cpu_has_avx512_vnni()}, {"AVX512_BF16", ggml_cpu_has_avx512_bf16()},
      {"NEON", ggml_cpu_has_neon()},         {"DOTPROD", ggml_cpu_has_dotprod()}};
  for (const auto& [name, on] : flags)
    if (on) s += (s.empty() ? "" : " ") + std::string(name);
  return s;
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
  m.def("supported", &supported, "whether ggml has a CPU dot product for this type");
  m.def("block_size", [](int64_t type) { return static_cast<int64_t>(ggml_blck_size(static_cast<ggml_type>(type))); },
        "values per block of this type");
  m.def("row_bytes", &row_bytes, "bytes of one row of K values of this type");
  m.def("cpu_features", &cpu_features, "the SIMD features ggml's CPU backend uses");
}
