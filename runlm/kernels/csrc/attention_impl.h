// Causal attention over a slot-addressed (paged) KV cache, fp32, for AVX2 + FMA CPUs, on raw pointers:
// attention.cpp wraps it for torch, native_abi.cpp for runlm's torch-free runner.
//
// One call per layer serves every sequence in the step, prefill chunks and decode tokens alike:
// query row t of sequence b sits at position p = context_len[b] - query_len[b] + i and attends
// to the positions max(0, p - window + 1) .. p of its context, whose K/V rows are read straight
// from the cache through the sequence's slot list (no gather copies). Scores may be soft-capped
// (softcap * tanh(s / softcap), Gemma 2) before the softmax, and a head may have a sink (gpt-oss): a learned
// logit that takes part in the softmax's normalization but adds no value row.
//
// Reduction order (what makes it batch-invariant): a row's result depends only on its own
// q, its own context and its position. Scores are 8-lane dot products over head_dim combined
// by a fixed tree; the softmax sum walks the positions in order, 8 lanes then a fixed tree;
// the output accumulates V rows position by position. Nothing depends on the other rows in the
// step, on how a prompt was cut into chunks, or on the thread count (threads split rows).
//
// Work unit: one (query row, KV head) pair computes all G = heads / kv_heads query heads that
// share the KV head, so each K and V row is loaded once for G heads (grouped-query attention).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel.h"

namespace runlm::attention {

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i first_lanes(int64_t r) {
  alignas(32) static const int32_t bits[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + 8 - r));
}

// e^x for x <= 0 (softmax inputs after subtracting the max), Cephes' single-precision method:
// x = n ln2 + r with |r| <= ln2/2, a degree-5 polynomial for e^r, then scale by 2^n. Relative
// error about 1e-7; inputs below -87 give 0's neighbourhood (e^-87 ~ 1.6e-38).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

struct Args {
  const float* q;        // [T, H, D]
  const float* k;        // [S, KVH, D]
  const float* v;        // [S, KVH, D]
  const int64_t* slots;  // concatenated context slots of every sequence
  float* out;            // [T, H, D]
  int64_t H, KVH, D, G, dfull;
  __m256i dtail;
  float scale;
  int64_t window;        // 0: none
  float softcap;         // 0: none; else scores pass through softcap * tanh(s / softcap) (Gemma 2)
  const float* sinks = nullptr;  // [H] or null: each head's sink logit (gpt-oss)
};

inline float dot(const Args& a, const float* x, const float* y) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d < a.dfull; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d), acc);
  if (d < a.D) acc = _mm256_fmadd_ps(_mm256_maskload_ps(x + d, a.dtail), _mm256_maskload_ps(y + d, a.dtail), acc);
  return hsum8(acc);
}

// Scores [G, L] of one row (KV head kvh's G query heads): soft-capped, then each head's row turned in place into
// e^(s - max) with inv[g] = 1 / its sum (the caller scales the weighted V sum by it); a head's sink joins the max
// and the sum. Shared by the q8_0 cache's rows.
inline void softmax(const Args& a, float* scores, int64_t L, float* inv, int64_t kvh) {
  if (a.softcap > 0.0f)
    for (int64_t i = 0; i < a.G * L; ++i) scores[i] = std::tanh(scores[i] / a.softcap) * a.softcap;
  const int64_t lfull = L / 8 * 8;
  const __m256i ltail = first_lanes(L - lfull);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t g = 0; g < a.G; ++g) {
    float* s = scores + g * L;
    __m256 mx = ninf;
    int64_t j = 0;
    for (; j < lfull; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    if (j < L) mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_maskload_ps(s + j, ltail), _mm256_castsi256_ps(ltail)));
    const float sink = a.sinks ? a.sinks[kvh * a.G + g] : -INFINITY;
    const float top = std::max(hmax8(mx), sink);
    const __m256 m = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j < lfull; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    if (j < L) {
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(s + j, ltail), m)), _mm256_castsi256_ps(ltail));
      _mm256_maskstore_ps(s + j, ltail, e);
      sum = _mm256_add_ps(sum, e);
    }
    inv[g] = 1.0f / (a.sinks ? hsum8(sum) + std::exp(sink - top) : hsum8(sum));
  }
}

// One query row t (at position p of a sequence whose slots start at `slots`) and one KV head.
// scores: scratch of G * (p + 1) floats; acc: G * D floats.
inline void row(const Args& a, int64_t t, int64_t kvh, int64_t p, const int64_t* slots, float* scores, float* acc) {
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
  const int64_t L = p - lo + 1;
  const float* q = a.q + (t * a.H + kvh * a.G) * a.D;
  for (int64_t j = 0; j < L; ++j) {
    const float* kr = a.k + (slots[lo + j] * a.KVH + kvh) * a.D;
    for (int64_t g = 0; g < a.G; ++g) scores[g * L + j] = dot(a, q + g * a.D, kr) * a.scale;
  }
  std::vector<float> inv(a.G);
  softmax(a, scores, L, inv.data(), kvh);
  std::fill(acc, acc + a.G * a.D, 0.0f);
  for (int64_t j = 0; j < L; ++j) {
    const float* vr = a.v + (slots[lo + j] * a.KVH + kvh) * a.D;
    for (int64_t g = 0; g < a.G; ++g) {
      const __m256 w = _mm256_set1_ps(scores[g * L + j]);
      float* o = acc + g * a.D;
      int64_t d = 0;
      for (; d < a.dfull; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + d), _mm256_loadu_ps(o + d)));
      for (; d < a.D; ++d) o[d] = std::fma(scores[g * L + j], vr[d], o[d]);
    }
  }
  for (int64_t g = 0; g < a.G; ++g) {
    float* dst = a.out + (t * a.H + kvh * a.G + g) * a.D;
    for (int64_t d = 0; d < a.D; ++d) dst[d] = acc[g * a.D + d] * inv[g];
  }
}

// Per query row: its sequence's first slot index (into the concatenated slots) and its position.
struct RowPlan {
  std::vector<int64_t> slot0, pos;
  int64_t max_len = 1;
};

// Checks the lengths against T rows and n_slots slots; an error message, or "" and the plan.
inline std::string plan_rows(const int64_t* query_lens, const int64_t* context_lens, int64_t batch, int64_t T,
                             int64_t n_slots, RowPlan& plan) {
  plan.slot0.resize(T);
  plan.pos.resize(T);
  plan.max_len = 1;
  int64_t t = 0, s0 = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t ql = query_lens[b], cl = context_lens[b];
    if (ql < 1 || ql > cl) return "runlm attention: bad query/context lengths";
    for (int64_t i = 0; i < ql; ++i, ++t) {
      if (t >= T) return "runlm attention: more query lengths than rows";
      plan.slot0[t] = s0;
      plan.pos[t] = cl - ql + i;
    }
    s0 += cl;
    plan.max_len = std::max(plan.max_len, cl);
  }
  if (t != T || s0 != n_slots) return "runlm attention: lengths do not add up to the inputs";
  return "";
}

inline bool cpu_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// out[T, H, D] for q[T, H, D] of all scheduled sequences (rows in batch order); k/v caches
// [S, KVH, D]; slots: every sequence's context slots, concatenated; plan: from plan_rows.
inline void paged_attention(const float* q, const float* k_cache, const float* v_cache, const int64_t* slots,
                            const RowPlan& plan, int64_t T, int64_t H, int64_t KVH, int64_t D, float scale,
                            int64_t window, float softcap, float* out, const float* sinks = nullptr) {
  const int64_t G = H / KVH, max_len = plan.max_len;
  Args a{q, k_cache, v_cache, slots, out, H, KVH, D, G, D / 8 * 8, first_lanes(D % 8), scale, window, softcap, sinks};
  // Tasks are (row, KV head) pairs; rows are taken alternately from both ends, so that the
  // contiguous ranges handed to threads mix short (early) and long (late) causal rows.
  const int64_t tasks = T * KVH;
  parallel_for(0, tasks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(G * max_len), acc(G * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / KVH, kvh = i % KVH;
      const int64_t row_t = (r % 2 == 0) ? r / 2 : T - 1 - r / 2;
      row(a, row_t, kvh, plan.pos[row_t], a.slots + plan.slot0[row_t], scores.data(), acc.data());
    }
  });
}

}  // namespace runlm::attention
