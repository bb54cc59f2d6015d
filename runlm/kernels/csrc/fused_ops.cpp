// The small per-layer ops of a decoder step, fused: each is one call instead of 5-20 torch ops.
//
// A decode step of a small model is otherwise dominated by op dispatch, not arithmetic (a
// 135M-parameter model ran ~900 aten ops per step, ~60% of the step). Every op here works row
// by row, so a row's result never depends on the other rows of the step (batch invariance).
//
//   rms_norm(x, w, eps)                         out = x / rms(x) * w
//   add_rms_norm(x, residual, w, eps)           residual += x; out = rms_norm(residual)
//   silu_mul(gate_up)                           [T, 2I] -> silu(gate) * up  [T, I]
//   gelu_tanh_mul(gate_up)                      [T, 2I] -> gelu_tanh(gate) * up  [T, I]
//   qkv_rope_store(qkv, ...)                    split a fused QKV row, optional per-head RMSNorm
//                                               of q and k, RoPE, K/V written to their cache
//                                               slots; returns q [T, H, D] for attention
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <initializer_list>
#include <optional>
#include <vector>

namespace {

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              " must be a contiguous fp32 CPU tensor");
}

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  double ss = 0.0;  // a double accumulator: the order of a row's sum cannot move its result much
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(w, "weight");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  TORCH_CHECK(w.numel() == n, "norm weight has ", w.numel(), " values for rows of ", n);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
  });
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  float* rp = residual.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0, total = rows * n; i < total; ++i) rp[i] += xp[i];
  return rms_norm(residual, w, eps);
}

// [T, 2I] -> act(gate) * up [T, I], row by row.
template <class Act>
at::Tensor gated(const at::Tensor& gate_up, Act act) {
  check_rows(gate_up, "gate_up");
  const int64_t two_i = gate_up.size(-1), inner = two_i / 2, rows = gate_up.numel() / std::max<int64_t>(two_i, 1);
  TORCH_CHECK(two_i % 2 == 0, "gate_up must have an even number of columns");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inner;
  at::Tensor out = at::empty(shape, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* gr = g + r * two_i;
      const float* ur = gr + inner;
      float* orow = o + r * inner;
      for (int64_t i = 0; i < inner; ++i) orow[i] = act(gr[i]) * ur[i];
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  return gated(gate_up, [](float x) { return x / (1.0f + std::exp(-x)); });
}

// GELU, tanh approximation (Gemma): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), torch's formula.
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  return gated(gate_up, [](float x) { return 0.5f * x * (1.0f + std::tanh(kBeta * (x + kKappa * x * x * x))); });
}

// One head of D values rotated in place by the table rows cos/sin (laid out as RotaryEmbedding
// builds them): pairs (i, i + D/2) for rotate-half, (2i, 2i + 1) for the interleaved layout.
inline void rope_head(float* x, const float* cos, const float* sin, int64_t d, bool interleaved) {
  if (interleaved) {
    for (int64_t i = 0; i < d; i += 2) {
      const float a = x[i], b = x[i + 1];
      x[i] = a * cos[i] + (-b) * sin[i];
      x[i + 1] = b * cos[i + 1] + a * sin[i + 1];
    }
  } else {
    const int64_t h = d / 2;
    for (int64_t i = 0; i < h; ++i) {
      const float a = x[i], b = x[i + h];
      x[i] = a * cos[i] + (-b) * sin[i];
      x[i + h] = b * cos[i + h] + a * sin[i + h];
    }
  }
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
  const float* qn = q_norm.has_value() && q_norm->defined() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() && k_norm->defined() ? k_norm->data_ptr<float>() : nullptr;
  const int64_t *pos = positions.data_ptr<int64_t>(), *sl = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "position ", pos[r], " is past the rope table");
    TORCH_CHECK(sl[r] >= 0 && sl[r] < k_cache.size(0), "cache slot ", sl[r], " is outside the cache");
  }
  at::Tensor q = at::empty({t, heads, d}, qkv.options());
  const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, 8, [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) {
      const float* row = src + r * width;
      const float *c = cp + pos[r] * d, *s = sp + pos[r] * d;
      for (int64_t h = 0; h < heads; ++h) {
        float* dst = qp + (r * heads + h) * d;
        if (qn) norm_row(row + h * d, qn, dst, d, e); else std::copy(row + h * d, row + (h + 1) * d, dst);
        rope_head(dst, c, s, d, interleaved);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* k = row + (heads + h) * d;
        float* kd = kc + (sl[r] * kv_heads + h) * d;
        if (kn) norm_row(k, kn, kd, d, e); else std::copy(k, k + d, kd);
        rope_head(kd, c, s, d, interleaved);
        const float* v = row + (heads + kv_heads + h) * d;
        std::copy(v, v + d, vc + (sl[r] * kv_heads + h) * d);
      }
    }
  });
  return q;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("gelu_tanh_mul", &gelu_tanh_mul);
  m.def("qkv_rope_store", &qkv_rope_store);
}
