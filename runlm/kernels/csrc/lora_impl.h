// LoRA adapters in the native decoder: after each base linear (GGUF blocks as stored), the rows of a step
// that run with adapter a get y[rows] += (x[rows] A^T) B^T, B holding the adapter's scale (Punica's and
// S-LoRA's idea: the base matrix once for every row, then one low-rank update per adapter for its rows).
// A fused projection (qkv, gate_up) holds one shard per adapted sub-projection: its rows of the stacked A
// and its B, added into its column range [lo, hi).
//
// The numbers are runlm.models.lora.LoRALayer.apply's on the torch fast path, to the bit: both products are
// fp32 dot products in csrc/linear.cpp's reduction order (one 8-lane FMA accumulator walking k in steps of
// 8, a masked tail, hsum8's fixed lane tree), and each update is added into the base output once. A row's
// result depends only on its own input and adapter, never on the other rows or the thread count.
// Adapters may instead be stored as fp16 (half the bytes a decode step streams; the products still in fp32
// in the same order, on the fp16 values): then the numbers are close to the torch path's, not equal.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "parallel.h"

// fp16 storage is read with F16C (every AVX2 CPU has it; checked where an fp16 adapter is set)
#pragma GCC push_options
#pragma GCC target("f16c")

namespace runlm::lora {

enum Proj : int { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3, kProjs = 4 };

struct Shard {
  int64_t lo, hi;  // output columns of the layer
  int64_t r0, r1;  // rows of the stacked A
  const void* b;   // B transposed: [r1 - r0, hi - lo], the scale folded in
};

struct Update {
  const void* a = nullptr;  // [rank, in]: every shard's A stacked
  int64_t rank = 0, in = 0;
  bool half = false;  // A and B hold fp16 values (else fp32)
  std::vector<Shard> shards;
};

using Adapter = std::vector<std::array<Update, kProjs>>;  // per layer, per projection (rank 0: none)

// The fixed lane-combine order of csrc/linear.cpp: (a0+a4, a1+a5, a2+a6, a3+a7) -> pairs -> total.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Multiply-adds per thread below which a product stays on the calling thread. High enough that a decode step's
// rank-16 products (a few 10k multiply-adds each) run on the calling thread: split, each of the ~11 products per
// layer was a parallel region of its own, and with OMP_WAIT_POLICY=PASSIVE (the benchmarks' setting) waking the
// other thread for each cost more than the product (smollm2, 2 threads: LoRA/base 0.45x split, 0.84x not;
// default policy 0.70x either way). Prompt chunks (tens of rows and more) still split.
constexpr int64_t kMinWork = int64_t{1} << 18;

// Lane mask selecting the first r (0..8) lanes, for the K tail.
inline __m256i first_lanes(int64_t r) {
  alignas(32) static const int32_t bits[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + 8 - r));
}

// out[j] = x . w[j] (add: out[j] += x . w[j]) for NB rows of w of k values, in csrc/linear.cpp's order: one
// 8-lane accumulator per output walking k in order (NB of them side by side only to hide the FMA latency).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load_tail(const float* p, __m256i mask, int64_t) { return _mm256_maskload_ps(p, mask); }
inline __m256 load_tail(const uint16_t* p, __m256i, int64_t r) {
  alignas(16) uint16_t part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::copy_n(p, r, part);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(part)));
}

template <int NB, class W>
inline void dots(const float* x, const W* w, int64_t k, float* out, bool add) {
  __m256 acc[NB];
  for (int j = 0; j < NB; ++j) acc[j] = _mm256_setzero_ps();
  const int64_t full = k / 8 * 8;
  for (int64_t i = 0; i < full; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int j = 0; j < NB; ++j) acc[j] = _mm256_fmadd_ps(xv, load8(w + j * k + i), acc[j]);
  }
  if (full < k) {
    const __m256i mask = first_lanes(k - full);
    const __m256 xv = _mm256_maskload_ps(x + full, mask);
    for (int j = 0; j < NB; ++j) acc[j] = _mm256_fmadd_ps(xv, load_tail(w + j * k + full, mask, k - full), acc[j]);
  }
  for (int j = 0; j < NB; ++j) out[j] = add ? out[j] + hsum8(acc[j]) : hsum8(acc[j]);
}

// yrows[i][n] = xrows[i][:k] . w[n, :k] for m rows and n outputs (add: +=). Threads split the outputs;
// small products stay on the calling thread.
template <class W>
void matmul(const float* const* xrows, int64_t m, int64_t k, const W* w, int64_t n, float* const* yrows, bool add) {
  constexpr int64_t kBlock = 8;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, kMinWork / std::max<int64_t>(1, m * k * kBlock));
  parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t j0 = b * kBlock, nb = std::min(kBlock, n - j0);
      for (int64_t i = 0; i < m; ++i) {
        if (nb == kBlock) {
          dots<kBlock, W>(xrows[i], w + j0 * k, k, yrows[i] + j0, add);
        } else {
          for (int64_t j = j0; j < j0 + nb; ++j) dots<1, W>(xrows[i], w + j * k, k, yrows[i] + j, add);
        }
      }
    }
  });
}

inline float scalar(float v) { return v; }
inline float scalar(uint16_t v) { return _cvtsh_ss(v); }

// yrows[i][j] += xrows[i][:k] . bt[:k, j] for m rows and n outputs, bt the B matrix transposed [k, n]: the same
// arithmetic as dots() per output (lane l of the 8-lane accumulator takes x[l], x[l + 8], ... by FMA; then
// hsum8's tree), but computed for 8 outputs at once with the outputs across the lanes: a rank-r product has
// r multiply-adds per output, too few to pay for a lane sum each.
template <class W>
void matmul_t(const float* const* xrows, int64_t m, int64_t k, const W* bt, int64_t n, float* const* yrows) {
  const int64_t steps = (k + 7) / 8, blocks = n / 8;
  const int64_t grain = std::max<int64_t>(1, kMinWork / std::max<int64_t>(1, m * k * 8));
  parallel_for(0, blocks + 1, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t i = 0; i < m; ++i) {
      const float* x = xrows[i];
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t j0 = b * 8;
        if (b < blocks) {
          __m256 acc[8];
          for (int l = 0; l < 8; ++l) acc[l] = _mm256_setzero_ps();
          for (int64_t s = 0; s < steps; ++s)
            for (int l = 0; l < 8; ++l) {
              const int64_t kk = s * 8 + l;
              const __m256 xv = _mm256_set1_ps(kk < k ? x[kk] : 0.0f);
              const __m256 wv = kk < k ? load8(bt + kk * n + j0) : _mm256_setzero_ps();
              acc[l] = _mm256_fmadd_ps(xv, wv, acc[l]);
            }
          const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
                                           _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])));
          float* y = yrows[i] + j0;
          _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), sum));
        } else {
          for (int64_t j = j0; j < n; ++j) {  // the last n % 8 outputs, one at a time (std::fma: the same rounding)
            float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t s = 0; s < steps; ++s)
              for (int l = 0; l < 8; ++l) {
                const int64_t kk = s * 8 + l;
                a[l] = kk < k ? std::fma(x[kk], scalar(bt[kk * n + j]), a[l]) : std::fma(0.0f, 0.0f, a[l]);
              }
            yrows[i][j] += ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
          }
        }
      }
    }
  });
}

// Every loaded adapter (by the engine's key) and the present step's rows per adapter.
struct Adapters {
  std::map<int64_t, Adapter> by_key;
  std::vector<std::pair<const Adapter*, std::vector<int64_t>>> groups;  // the step's, in first-row order
  int64_t step_rows = 0;  // rows the groups were set for (0: none set)
  std::vector<float> h;  // [rows, rank]: x A^T
  std::vector<const float*> xrows, hsub;
  std::vector<float*> hrows, yrows, ysub;

  // Adapter key's update of one layer's projection p (the layer's linear maps in -> width features):
  // a [rank, in]; shards [n, 4] (lo, hi, r0, r1) with their B matrices, transposed ([r1 - r0, hi - lo]), one
  // after another in b; half: a and b hold fp16 values, else fp32. "" or an error.
  std::string set(int64_t key, size_t layers, size_t layer, int p, const void* a, int64_t rank, int64_t in,
                  int64_t width, int64_t n_shards, const int64_t* shards, const void* b, bool half) {
    if (key <= 0) return "a LoRA adapter's key must be positive";
    if (layer >= layers) return "no layer " + std::to_string(layer);
    if (p < 0 || p >= kProjs) return "no projection " + std::to_string(p) + " (0 qkv, 1 o, 2 gate_up, 3 down)";
    if (rank <= 0 || n_shards <= 0 || !a || !b) return "a LoRA update needs a rank and at least one shard";
    if (half && !__builtin_cpu_supports("f16c")) return "fp16 LoRA adapters need a CPU with F16C";
    Update u{a, rank, in, half, {}};
    const int64_t item = half ? 2 : 4;
    int64_t used = 0, prev_hi = 0;
    for (int64_t i = 0; i < n_shards; ++i) {
      const int64_t lo = shards[4 * i], hi = shards[4 * i + 1], r0 = shards[4 * i + 2], r1 = shards[4 * i + 3];
      if (lo < prev_hi || hi <= lo || hi > width || r0 < 0 || r1 <= r0 || r1 > rank)
        return "LoRA shard " + std::to_string(i) + " (columns " + std::to_string(lo) + ".." + std::to_string(hi) +
               ", A rows " + std::to_string(r0) + ".." + std::to_string(r1) + ") does not fit a layer of " +
               std::to_string(width) + " outputs and a rank of " + std::to_string(rank);
      u.shards.push_back({lo, hi, r0, r1, static_cast<const char*>(b) + used * item});
      used += (hi - lo) * (r1 - r0), prev_hi = hi;
    }
    Adapter& adapter = by_key[key];
    adapter.resize(layers);
    adapter[layer][static_cast<size_t>(p)] = std::move(u);
    return "";
  }

  void drop(int64_t key) {
    if (by_key.erase(key)) groups.clear(), step_rows = 0;  // the step's groups may point at it
  }

  // Each row's adapter key for the next steps (0: none); t == 0 clears. "" or an error.
  std::string set_rows(const int64_t* keys, int64_t t) {
    groups.clear();
    step_rows = 0;
    std::map<int64_t, size_t> at;
    for (int64_t r = 0; r < t; ++r) {
      if (keys[r] == 0) continue;
      auto found = by_key.find(keys[r]);
      if (found == by_key.end()) {
        groups.clear();
        return "no LoRA adapter with key " + std::to_string(keys[r]) + " is set";
      }
      auto [it, fresh] = at.emplace(keys[r], groups.size());
      if (fresh) groups.push_back({&found->second, {}});
      groups[it->second].second.push_back(r);
    }
    step_rows = t;
    return "";
  }

  std::string check_step(int64_t t) const {
    if (step_rows != 0 && step_rows != t)
      return "LoRA rows were set for " + std::to_string(step_rows) + " rows, the step has " + std::to_string(t);
    return "";
  }

  // y [t, width] (the base output for x [t, in]) plus each row's update of layer's projection p.
  void apply(size_t layer, Proj p, const float* x, int64_t in, float* y, int64_t width) {
    for (const auto& [adapter, rows] : groups) {
      const Update& u = (*adapter)[layer][p];
      if (u.rank == 0) continue;
      const size_t m = rows.size();
      xrows.resize(m), hrows.resize(m), yrows.resize(m), hsub.resize(m), ysub.resize(m);
      h.resize(m * static_cast<size_t>(u.rank));
      for (size_t i = 0; i < m; ++i) {
        xrows[i] = x + rows[i] * in;
        hrows[i] = h.data() + i * static_cast<size_t>(u.rank);
        yrows[i] = y + rows[i] * width;
      }
      if (u.half)
        matmul(xrows.data(), static_cast<int64_t>(m), in, static_cast<const uint16_t*>(u.a), u.rank, hrows.data(),
               false);
      else
        matmul(xrows.data(), static_cast<int64_t>(m), in, static_cast<const float*>(u.a), u.rank, hrows.data(),
               false);
      for (const Shard& s : u.shards) {
        for (size_t i = 0; i < m; ++i) hsub[i] = hrows[i] + s.r0, ysub[i] = yrows[i] + s.lo;
        if (u.half)
          matmul_t(hsub.data(), static_cast<int64_t>(m), s.r1 - s.r0, static_cast<const uint16_t*>(s.b), s.hi - s.lo,
                   ysub.data());
        else
          matmul_t(hsub.data(), static_cast<int64_t>(m), s.r1 - s.r0, static_cast<const float*>(s.b), s.hi - s.lo,
                   ysub.data());
      }
    }
  }
};

}  // namespace runlm::lora

#pragma GCC pop_options
