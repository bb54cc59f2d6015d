// The small per-layer ops of a decoder step, fused, on raw pointers: each is one call instead of
// 5-20 torch ops. fused_ops.cpp wraps them for torch, native_abi.cpp for runlm's torch-free runner.
//
// A decode step of a small model is otherwise dominated by op dispatch, not arithmetic (a
// 135M-parameter model ran ~900 aten ops per step, ~60% of the step). Every op here works row
// by row, so a row's result never depends on the other rows of the step (batch invariance).
//
//   rms_norm(x, w, eps)                         out = x / rms(x) * w
//   add_rms_norm(x, residual, w, eps)           residual += x; out = rms_norm(residual)
//   silu_mul(gate_up)                           [T, 2I] -> silu(gate) * up  [T, I]
//   gelu_tanh_mul(gate_up)                      [T, 2I] -> gelu_tanh(gate) * up  [T, I]
//   qkv_rope_store(qkv, ...)                    split a fused QKV row, optional RMSNorm of q and k
//                                               (per head, or over the whole projection: OLMo2/
//                                               OLMoE), RoPE (of the first rotary features of each
//                                               head: partial rotary), K/V written to their cache
//                                               slots; writes q [T, H, D] for attention
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "parallel.h"

namespace runlm::fused {

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  double ss = 0.0;  // a double accumulator: the order of a row's sum cannot move its result much
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// out[rows, n] = rms_norm of each row of x (out may be x).
inline void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps) {
  parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(x + r * n, w, out + r * n, n, eps);
  });
}

inline void add_rms_norm(const float* x, float* residual, const float* w, float* out, int64_t rows, int64_t n,
                         float eps) {
  for (int64_t i = 0, total = rows * n; i < total; ++i) residual[i] += x[i];
  rms_norm(residual, w, out, rows, n, eps);
}

// [rows, 2I] -> act(gate) * up [rows, I], row by row.
template <class Act>
void gated(const float* gate_up, float* out, int64_t rows, int64_t inner, Act act) {
  const int64_t two_i = 2 * inner;
  parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* gr = gate_up + r * two_i;
      const float* ur = gr + inner;
      float* orow = out + r * inner;
      for (int64_t i = 0; i < inner; ++i) orow[i] = act(gr[i]) * ur[i];
    }
  });
}

inline void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inner) {
  gated(gate_up, out, rows, inner, [](float x) { return x / (1.0f + std::exp(-x)); });
}

// GELU, tanh approximation (Gemma): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), torch's formula.
inline void gelu_tanh_mul(const float* gate_up, float* out, int64_t rows, int64_t inner) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  gated(gate_up, out, rows, inner,
        [](float x) { return 0.5f * x * (1.0f + std::tanh(kBeta * (x + kKappa * x * x * x))); });
}

// The first d values of one head rotated in place by the table rows cos/sin [d] (laid out as
// RotaryEmbedding builds them): pairs (i, i + d/2) for rotate-half, (2i, 2i + 1) for the interleaved
// layout. d is the head's rotary features (all of them but with partial rotary).
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

struct QkvShape {
  int64_t t, heads, kv_heads, d;
  int64_t table_rows;  // positions the cos/sin tables cover
  int64_t cache_slots;
  bool interleaved;
  int64_t rotary = 0;          // features of each head RoPE rotates (the tables' width); 0: all d
  bool qk_norm_whole = false;  // q_norm [H D] / k_norm [KVH D] normalize the whole projection, not each head
};

// Positions and slots in range; an error message, or "" when they are.
inline std::string check_qkv_rows(const QkvShape& s, const int64_t* pos, const int64_t* slots) {
  for (int64_t r = 0; r < s.t; ++r) {
    if (pos[r] < 0 || pos[r] >= s.table_rows) return "position " + std::to_string(pos[r]) + " is past the rope table";
    if (slots[r] < 0 || slots[r] >= s.cache_slots)
      return "cache slot " + std::to_string(slots[r]) + " is outside the cache";
  }
  return "";
}

// qkv [T, (H + 2 KVH) D]; cos/sin [table_rows, rotary]; caches [slots, KVH, D]; q_norm/k_norm [D] (or
// [H D] / [KVH D] with qk_norm_whole) or null; q [T, H, D] out. Positions and slots must have passed
// check_qkv_rows.
inline void qkv_rope_store(const float* qkv, const int64_t* pos, const float* cos, const float* sin, float* k_cache,
                           float* v_cache, const int64_t* slots, const QkvShape& s, const float* q_norm,
                           const float* k_norm, float eps, float* q) {
  const int64_t heads = s.heads, kv_heads = s.kv_heads, d = s.d, width = (heads + 2 * kv_heads) * d;
  const int64_t rot = s.rotary > 0 ? s.rotary : d;
  const bool interleaved = s.interleaved;
  const bool q_whole = s.qk_norm_whole && q_norm, k_whole = s.qk_norm_whole && k_norm;  // one norm per row
  parallel_for(0, s.t, 8, [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r) {
      const float* row = qkv + r * width;
      const float *c = cos + pos[r] * rot, *sn = sin + pos[r] * rot;
      float* qrow = q + r * heads * d;
      if (q_whole) norm_row(row, q_norm, qrow, heads * d, eps);
      for (int64_t h = 0; h < heads; ++h) {
        float* dst = qrow + h * d;
        if (q_whole) {  // normalized above, all heads at once
        } else if (q_norm) {
          norm_row(row + h * d, q_norm, dst, d, eps);
        } else {
          std::copy(row + h * d, row + (h + 1) * d, dst);
        }
        rope_head(dst, c, sn, rot, interleaved);
      }
      float* krow = k_cache + slots[r] * kv_heads * d;
      if (k_whole) norm_row(row + heads * d, k_norm, krow, kv_heads * d, eps);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* k = row + (heads + h) * d;
        float* kd = krow + h * d;
        if (k_whole) {  // normalized above
        } else if (k_norm) {
          norm_row(k, k_norm, kd, d, eps);
        } else {
          std::copy(k, k + d, kd);
        }
        rope_head(kd, c, sn, rot, interleaved);
        const float* v = row + (heads + kv_heads + h) * d;
        std::copy(v, v + d, v_cache + (slots[r] * kv_heads + h) * d);
      }
    }
  });
}

}  // namespace runlm::fused
