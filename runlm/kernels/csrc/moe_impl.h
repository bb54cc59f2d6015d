// A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on raw pointers, for the native
// decoder (native_decoder.h calls it in place of a dense layer's gate_up / act / down).
//
// What it computes is runlm/models/moe.py's SparseMoeBlock, step by step: router logits (an fp32
// router by linear.cpp's reduction order, so the same floats as the torch fast path; a quantized one
// through gl::linear), a softmax over all experts, the top k (renormalized to sum to 1 where the
// family does), then for every expert in ascending order its rows' gate_up, act·mul, down, each
// times its weight and added to the row's output (the order torch's index_add_ adds them), plus
// Qwen2-MoE's shared expert scaled by sigmoid(gate · x). gpt-oss's experts add a router bias to the logits,
// biases to each expert's gate_up and down outputs, and take its clamped SwiGLU:
// (clamp(up, -limit, limit) + 1) · g · sigmoid(1.702 g), g = min(gate, limit).
//
// Threading: a decode step sends each token to k small experts; one parallel region per expert and
// projection would cost a fork/join each. Instead the rows are grouped by expert (a packed copy of x,
// quantized once), and every chosen expert's weight panels form one list of work items that one
// parallel region shares out by cost: two regions per layer (gate_up, down) whatever k. Results do not
// depend on the threads or on the other rows (each output is one weight row's dot with one x row).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fused_ops_impl.h"
#include "ggml_linear_impl.h"
#include "parallel.h"

namespace runlm::moe {

namespace gl = runlm::ggml_linear;

// x · w over k floats in linear.cpp's order: one 8-lane FMA accumulator walking k, a masked tail, its
// fixed lane tree; the torch fast path's fp32 router gives these bits.
inline float dot_f32(const float* x, const float* w, int64_t k) {
  __m256 acc = _mm256_setzero_ps();
  const int64_t kfull = k / 8 * 8;
  for (int64_t i = 0; i < kfull; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), acc);
  if (kfull < k) {
    alignas(32) static const int32_t bits[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    const __m256i tail = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + 8 - (k - kfull)));
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(x + kfull, tail), _mm256_maskload_ps(w + kfull, tail), acc);
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A stacked [E, rows, K] expert tensor in one ggml type: expert e's rows at data + e * rows * row_bytes.
struct Stack {
  const uint8_t* data = nullptr;
  int64_t type = 0, rows = 0, k = 0;
  int64_t row_bytes() const { return gl::row_bytes(type, k); }
  gl::Segment expert(int64_t e) const {
    const int64_t rb = row_bytes();
    return {data + e * rows * rb, rows, rb, type};
  }
};

// Per-step buffers, kept by the caller between steps.
struct Scratch {
  std::vector<float> logits, weights, xs, gu, act, ys, shared_gu, shared_act, shared_y;
  std::vector<int64_t> chosen, count, start, row_of, token_of;
  std::vector<float> weight_of;
  gl::Scratch qx, qact;
  gl::Scratch shared_q;
};

struct Experts {
  int64_t n_experts = 0, top_k = 0, hidden = 0, inner = 0;
  bool renormalize = false, gelu = false;
  const float* router_f32 = nullptr;  // [E, hidden] fp32, or null: router_plan
  gl::Plan router_plan;
  std::vector<gl::Plan> gate_up, down;  // per expert: [2I, hidden] (gate rows, then up), [hidden, I]
  // Qwen2-MoE's shared expert (null: none) and its gate [hidden] (null: ungated)
  const gl::Plan *shared_gate_up = nullptr, *shared_down = nullptr;
  const float* shared_gate = nullptr;
  // gpt-oss (null / 0: none): the router's bias [E], each expert's gate_up bias [E, 2I] (its gate's, then its
  // up's) and down bias [E, hidden], and the clamped SwiGLU's limit
  const float *router_bias = nullptr, *gate_up_bias = nullptr, *down_bias = nullptr;
  float swiglu_limit = 0.0f;

  // Plans for every expert; an error message, or "". gate: [E, I, hidden] and up [E, I, hidden], or gate
  // [E, 2I, hidden] (llama.cpp's merged gate_up, the gate's rows first) and up.data null.
  std::string build(const Stack& gate, const Stack& up, const Stack& dn) {
    gate_up.assign(static_cast<size_t>(n_experts), {});
    down.assign(static_cast<size_t>(n_experts), {});
    if (n_experts <= 0 || top_k <= 0 || top_k > n_experts) return "experts: top_k must be in [1, experts]";
    for (int64_t e = 0; e < n_experts; ++e) {
      std::vector<gl::Segment> segs{gate.expert(e)};
      if (up.data) segs.push_back(up.expert(e));
      std::string bad = gl::make_plan(std::move(segs), hidden, false, gate_up[e]);
      if (bad.empty()) bad = gl::make_plan({dn.expert(e)}, inner, false, down[e]);
      if (!bad.empty()) return "expert " + std::to_string(e) + ": " + bad;
      if (gate_up[e].col0.back() != 2 * inner || down[e].col0.back() != hidden)
        return "expert " + std::to_string(e) + ": gate_up must be [2 I, hidden] and down [hidden, I]";
    }
    return "";
  }

  // out [t, hidden] = the mixture's output for x [t, hidden].
  void apply(const float* x, int64_t t, float* out, Scratch& s) const {
    if (t == 0) return;
    route(x, t, s);
    const int64_t a = t * top_k, two_i = 2 * inner;
    grow(s.xs, a * hidden), grow(s.gu, a * two_i), grow(s.act, a * inner), grow(s.ys, a * hidden);
    for (int64_t j = 0; j < a; ++j)
      std::memcpy(s.xs.data() + j * hidden, x + s.token_of[j] * hidden, sizeof(float) * static_cast<size_t>(hidden));
    grouped(gate_up, s.xs.data(), hidden, s.gu.data(), two_i, s.qx, s);
    if (gate_up_bias) add_expert_bias(gate_up_bias, s.gu.data(), two_i, s);
    if (swiglu_limit > 0.0f)
      clamped_swiglu(s.gu.data(), s.act.data(), a);
    else if (gelu)
      fused::gelu_tanh_mul(s.gu.data(), s.act.data(), a, inner);
    else
      fused::silu_mul(s.gu.data(), s.act.data(), a, inner);
    grouped(down, s.act.data(), inner, s.ys.data(), hidden, s.qact, s);
    if (down_bias) add_expert_bias(down_bias, s.ys.data(), hidden, s);
    std::fill(out, out + t * hidden, 0.0f);
    for (int64_t j = 0; j < a; ++j) {  // expert by expert, ascending: index_add_'s order
      float* o = out + s.token_of[j] * hidden;
      const float* y = s.ys.data() + j * hidden;
      const float w = s.weight_of[j];
      for (int64_t c = 0; c < hidden; ++c) o[c] = o[c] + y[c] * w;
    }
    if (shared_gate_up) add_shared(x, t, out, s);
  }

 private:
  // y's packed rows (grouped by expert) += their expert's bias [E, n]
  void add_expert_bias(const float* bias, float* y, int64_t n, const Scratch& s) const {
    for (int64_t e = 0; e < n_experts; ++e) {
      const float* b = bias + e * n;
      for (int64_t j = s.start[e]; j < s.start[e] + s.count[e]; ++j) {
        float* row = y + j * n;
        for (int64_t c = 0; c < n; ++c) row[c] = row[c] + b[c];
      }
    }
  }

  // act [m, I] = gpt-oss's clamped SwiGLU of gu [m, 2I] (each row's gate, then its up)
  void clamped_swiglu(const float* gu, float* act, int64_t m) const {
    constexpr float kAlpha = 1.702f;
    const float lim = swiglu_limit;
    for (int64_t r = 0; r < m; ++r) {
      const float *g = gu + r * 2 * inner, *u = g + inner;
      float* o = act + r * inner;
      for (int64_t c = 0; c < inner; ++c) {
        const float gate = std::min(g[c], lim), up = std::min(std::max(u[c], -lim), lim);
        o[c] = (up + 1.0f) * (gate / (1.0f + std::exp(-gate * kAlpha)));
      }
    }
  }

  static void grow(std::vector<float>& v, int64_t n) {
    if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
  }

  // Each row's top k experts and weights, then the assignments grouped by expert: row j of the packed
  // buffers is token_of[j] for the expert whose range [start[e], start[e] + count[e]) holds j.
  void route(const float* x, int64_t t, Scratch& s) const {
    const int64_t ne = n_experts, k = top_k;
    grow(s.logits, t * ne);
    if (router_f32) {
      for (int64_t r = 0; r < t; ++r)
        for (int64_t e = 0; e < ne; ++e) s.logits[r * ne + e] = dot_f32(x + r * hidden, router_f32 + e * hidden, hidden);
    } else {
      gl::linear(x, t, router_plan, nullptr, s.logits.data(), s.qx);
    }
    if (router_bias)
      for (int64_t r = 0; r < t; ++r)
        for (int64_t e = 0; e < ne; ++e) s.logits[r * ne + e] = s.logits[r * ne + e] + router_bias[e];
    s.chosen.resize(static_cast<size_t>(t * k));
    grow(s.weights, t * k);
    std::vector<float> p(static_cast<size_t>(ne));
    for (int64_t r = 0; r < t; ++r) {
      const float* l = s.logits.data() + r * ne;
      const float mx = *std::max_element(l, l + ne);
      float sum = 0.0f;
      for (int64_t e = 0; e < ne; ++e) sum += (p[e] = std::exp(l[e] - mx));
      for (int64_t e = 0; e < ne; ++e) p[e] = p[e] / sum;
      int64_t* c = s.chosen.data() + r * k;
      float* w = s.weights.data() + r * k;
      for (int64_t i = 0; i < k; ++i) {  // the largest first; ties to the lower expert
        int64_t best = -1;
        for (int64_t e = 0; e < ne; ++e) {
          if (std::find(c, c + i, e) != c + i) continue;
          if (best < 0 || p[e] > p[best]) best = e;
        }
        c[i] = best, w[i] = p[best];
      }
      if (renormalize) {
        float total = 0.0f;
        for (int64_t i = 0; i < k; ++i) total += w[i];
        for (int64_t i = 0; i < k; ++i) w[i] = w[i] / total;
      }
    }
    s.count.assign(static_cast<size_t>(ne), 0);
    for (int64_t j = 0; j < t * k; ++j) ++s.count[s.chosen[j]];
    s.start.assign(static_cast<size_t>(ne), 0);
    for (int64_t e = 1; e < ne; ++e) s.start[e] = s.start[e - 1] + s.count[e - 1];
    s.token_of.resize(static_cast<size_t>(t * k));
    s.weight_of.resize(static_cast<size_t>(t * k));
    std::vector<int64_t> next(s.start);
    for (int64_t r = 0; r < t; ++r)  // tokens ascending within an expert, as torch.where gives them
      for (int64_t i = 0; i < k; ++i) {
        const int64_t j = next[s.chosen[r * k + i]]++;
        s.token_of[j] = r, s.weight_of[j] = s.weights[r * k + i];
      }
  }

  // y rows [start[e], +count[e]) = x rows (packed, grouped by expert) @ plans[e]^T, for every chosen
  // expert, in one parallel region: every expert's work items in one list, cut by cost.
  void grouped(const std::vector<gl::Plan>& plans, const float* xs, int64_t k, float* y, int64_t n,
               gl::Scratch& qx, Scratch& s) const {
    const int64_t a = static_cast<int64_t>(s.token_of.size());
    const gl::Plan& p0 = plans[0];  // every expert's tensors share their types: one quantized copy of x
    if (qx.size() < p0.xtypes.size()) qx.resize(p0.xtypes.size());
    for (size_t i = 0; i < p0.xtypes.size(); ++i) {
      gl::quantize_rows(xs, a, k, p0.xtypes[i], qx[i]);
      if (p0.x_sums[i]) gl::compute_block_sums(qx[i], a, k);
    }
    struct Work { int64_t e; size_t item; int64_t cost; };
    std::vector<Work> work;
    int64_t total = 0;
    for (int64_t e = 0; e < n_experts; ++e) {
      if (s.count[e] == 0) continue;
      const gl::Plan& p = plans[e];
      const int64_t per_item = std::max<int64_t>(1, p.wbytes / static_cast<int64_t>(p.items.size()));
      for (size_t it = 0; it < p.items.size(); ++it) {
        const int64_t cost = per_item + per_item * (s.count[e] - 1) / 8;  // weights read once, reused by rows
        work.push_back({e, it, cost});
        total += cost;
      }
    }
    const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(max_threads(), total / gl::kMinBytesPerThread));
    std::vector<size_t> cut(static_cast<size_t>(tasks) + 1, work.size());
    cut[0] = 0;
    for (int64_t i = 1, acc = 0, w = 0; i < tasks; ++i) {
      while (static_cast<size_t>(w) < work.size() && acc < total * i / tasks) acc += work[static_cast<size_t>(w++)].cost;
      cut[static_cast<size_t>(i)] = static_cast<size_t>(w);
    }
    parallel_for(0, tasks, 1, [&](int64_t b, int64_t e) {
      for (int64_t task = b; task < e; ++task)
        for (size_t w = cut[task]; w < cut[task + 1]; ++w) {
          const Work& wk = work[w];
          run_item(plans[wk.e], plans[wk.e].items[wk.item], qx, s.start[wk.e], s.count[wk.e], y + s.start[wk.e] * n, n);
        }
    });
  }

  // One work item of a plan (rows [lo, hi) of one segment) for x rows [row0, row0 + m) of qx.
  static void run_item(const gl::Plan& p, const gl::Plan::Item& item, const gl::Scratch& qx, int64_t row0, int64_t m,
                       float* y, int64_t n) {
    const gl::Segment& w = p.segs[item.seg];
    const gl::QuantizedRows& xq = qx[p.seg_x[item.seg]];
    const uint8_t* xd = xq.data + row0 * xq.stride;
    const int64_t k = p.k;
    if (const gl::BlockRows kernel = p.ours[item.seg].rows) {
      const int32_t* sums = xq.sums ? xq.block_sums.data() + row0 * (k / blockgemm::QK) : nullptr;
      kernel(w.data, w.row_bytes, xd, xq.stride, sums, m, k / gl::block_size(w.type), y + p.col0[item.seg], n, item.lo,
             item.hi, p.zero_rows[item.seg].data());
      return;
    }
    const ggml_vec_dot_t dot = gl::cpu_traits(w.type)->vec_dot;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t r = item.lo; r < item.hi; ++r)
        dot(static_cast<int>(k), y + i * n + p.col0[item.seg] + r, 0, w.data + r * w.row_bytes, 0, xd + i * xq.stride,
            0, 1);
  }

  void add_shared(const float* x, int64_t t, float* out, Scratch& s) const {
    const int64_t si = shared_gate_up->col0.back() / 2;
    grow(s.shared_gu, t * 2 * si), grow(s.shared_act, t * si), grow(s.shared_y, t * hidden);
    gl::linear(x, t, *shared_gate_up, nullptr, s.shared_gu.data(), s.shared_q);
    if (gelu)
      fused::gelu_tanh_mul(s.shared_gu.data(), s.shared_act.data(), t, si);
    else
      fused::silu_mul(s.shared_gu.data(), s.shared_act.data(), t, si);
    gl::linear(s.shared_act.data(), t, *shared_down, nullptr, s.shared_y.data(), s.shared_q);
    for (int64_t r = 0; r < t; ++r) {
      const float g = shared_gate ? 1.0f / (1.0f + std::exp(-dot_f32(x + r * hidden, shared_gate, hidden))) : 1.0f;
      float* o = out + r * hidden;
      const float* y = s.shared_y.data() + r * hidden;
      for (int64_t c = 0; c < hidden; ++c) o[c] = o[c] + g * y[c];
    }
  }
};

}  // namespace runlm::moe
