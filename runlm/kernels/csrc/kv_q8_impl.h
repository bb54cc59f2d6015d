// Packed KV caches for runlm's torch-free runner: fp16 rows (--kv-cache-dtype fp16, the runner's default: 2 bytes
// a value, half the fp32 cache's memory and reads) and an 8-bit cache in llama.cpp's q8_0 block format (per 32
// values: an fp16 scale d, then 32 int8 q; value = d * q; --kv-cache-dtype q8_0): 34 bytes per 32 values instead
// of 128, so a cache holds ~3.76x the tokens of the fp32 one. fp16 rows are rounded to nearest (F16C's
// vcvtps2ph), any head_dim; the rest of this note is about both.
//
// Writing: the step's K/V rows are computed in fp32 exactly as for the fp32 cache (qkv_rope_store into
// a step-sized staging buffer), then each (row, KV head) is quantized into its cache slot (quantize_row:
// ggml's rule, d = max|x| / 127 and q = round(x / d), with the scale fitted among a few candidates). Reading: attention dequantizes each
// K and V row of the context once per (query row, KV head) into fp32 and runs the fp32 path's dot
// products, softmax and weighted sum on it, so q stays fp32 (llama.cpp quantizes q to q8_0 for its
// K dot products; keeping it fp32 costs little and loses nothing). Every result still depends only on
// the row's own q, context and position: batch-invariant, as the fp32 path.
//
// q8_0 needs head_dim a multiple of 32 (checked where the cache is set).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attention_impl.h"
#include "parallel.h"

namespace runlm::kv_q8 {

constexpr int64_t kBlock = 32, kBlockBytes = 2 + kBlock;
constexpr int kFits = 8;  // candidate steps max|x| / (127 + c), c < kFits, for each block's scale

inline int64_t row_bytes(int64_t d) { return d / kBlock * kBlockBytes; }

inline std::string check_head_dim(int64_t d) {
  if (d <= 0 || d % kBlock != 0) return "a q8_0 KV cache needs head_dim a multiple of 32, not " + std::to_string(d);
  return "";
}

inline float from_bits(uint32_t w) { float f; std::memcpy(&f, &w, 4); return f; }
inline uint32_t to_bits(float f) { uint32_t w; std::memcpy(&w, &f, 4); return w; }

// IEEE half <-> float without F16C (the library is built for AVX2 + FMA only): ggml's (the FP16
// library's) bit-exact conversions, denormals included.
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normalized = from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return from_bits(sign | (two_w < (1u << 27) ? to_bits(denormalized) : to_bits(normalized)));
}

inline uint16_t fp32_to_fp16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = to_bits(base), nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// x [d] -> y [row_bytes(d)]: llama.cpp's q8_0 blocks. Each block's scale is fitted rather than taken as
// ggml's max|x| / 127: for kFits candidate steps (max|x| / 127 and slightly smaller ones, down to
// max|x| / 134, which let the largest values clip at 127 / -128) the int8 values are rounded (to nearest,
// ties to even), the scale is refitted to them by least squares and rounded to fp16, and the pair with the
// smallest squared error is stored. Readers dequantize it as any q8_0 block (d * q). Measured on smollm2
// (bench/kv_cache_bench.py): KL from the fp32 cache 0.00425 against ggml's rule's 0.00430-0.00439.
inline void quantize_row(const float* x, uint8_t* y, int64_t d) {
  using attention::hsum8;
  const __m256 lo = _mm256_set1_ps(-128.0f), hi = _mm256_set1_ps(127.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < d / kBlock; ++b, x += kBlock, y += kBlockBytes) {
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k), mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[k]));
    const float amax = attention::hmax8(mx);
    __m256i best[4] = {};
    uint16_t best_h = 0;
    if (amax > 0.0f) {
      float best_err = INFINITY;
      for (int c = 0; c < kFits; ++c) {
        const __m256 inv = _mm256_set1_ps((127.0f + static_cast<float>(c)) / amax);
        __m256 r[4], xq = _mm256_setzero_ps(), qq = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) {
          r[k] = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(_mm256_mul_ps(v[k], inv),
                                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
          xq = _mm256_fmadd_ps(v[k], r[k], xq), qq = _mm256_fmadd_ps(r[k], r[k], qq);
        }
        const uint16_t h = fp32_to_fp16(hsum8(xq) / hsum8(qq));
        const __m256 sc = _mm256_set1_ps(fp16_to_fp32(h));
        __m256 err = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) {
          const __m256 e = _mm256_fnmadd_ps(sc, r[k], v[k]);
          err = _mm256_fmadd_ps(e, e, err);
        }
        const float total = hsum8(err);
        if (total < best_err) {
          best_err = total, best_h = h;
          for (int k = 0; k < 4; ++k) best[k] = _mm256_cvtps_epi32(r[k]);
        }
      }
    }
    std::memcpy(y, &best_h, 2);
    for (int k = 0; k < 4; ++k) {  // 8 int32 in [-128, 127] -> 8 int8
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(best[k]), _mm256_extracti128_si256(best[k], 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(y + 2 + 8 * k), _mm_packs_epi16(w, w));
    }
  }
}

// x [row_bytes(d)] -> y [d] fp32.
inline void dequantize_row(const uint8_t* x, float* y, int64_t d) {
  for (int64_t b = 0; b < d / kBlock; ++b, x += kBlockBytes, y += kBlock) {
    uint16_t h;
    std::memcpy(&h, x, 2);
    const __m256 s = _mm256_set1_ps(fp16_to_fp32(h));
    for (int64_t i = 0; i < kBlock; i += 8) {
      const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + 2 + i)));
      _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_cvtepi32_ps(q)));
    }
  }
}

// x [d] fp32 -> y [d] fp16, rounded to nearest even.
inline void to_half_row(const float* x, uint16_t* y, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < d; ++i) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

// x [d] fp16 -> y [d] fp32 (exact).
inline void from_half_row(const uint16_t* x, float* y, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
  for (; i < d; ++i) y[i] = _cvtsh_ss(x[i]);
}

// Each layer's two caches, [cache_slots, KVH, bytes(D)] bytes each: q8_0 blocks, or fp16 rows where ``half``;
// null: the layer's cache is fp32.
struct Cache {
  uint8_t *k = nullptr, *v = nullptr;
  bool half = false;

  int64_t bytes(int64_t d) const { return half ? 2 * d : row_bytes(d); }

  void pack(const float* x, uint8_t* y, int64_t d) const {
    if (half) to_half_row(x, reinterpret_cast<uint16_t*>(y), d);
    else quantize_row(x, y, d);
  }

  void unpack(const uint8_t* x, float* y, int64_t d) const {
    if (half) from_half_row(reinterpret_cast<const uint16_t*>(x), y, d);
    else dequantize_row(x, y, d);
  }
};

// The step's fp32 K/V rows before they are quantized: [T, KVH, D] each, and the slots 0..T-1 that
// qkv_rope_store writes them to.
struct Staging {
  std::vector<float> k, v;
  std::vector<int64_t> slots;

  void grow(int64_t t, int64_t width) {
    if (static_cast<int64_t>(slots.size()) >= t && static_cast<int64_t>(k.size()) >= t * width) return;
    k.resize(static_cast<size_t>(t * width)), v.resize(static_cast<size_t>(t * width));
    slots.resize(static_cast<size_t>(t));
    for (int64_t i = 0; i < t; ++i) slots[static_cast<size_t>(i)] = i;
  }
};

// Rows [T, KVH, D] of k and v packed into the caches at slot_mapping[T].
inline void store(const float* k, const float* v, const int64_t* slot_mapping, int64_t t, int64_t kv_heads, int64_t d,
                  const Cache& cache) {
  const int64_t rb = cache.bytes(d);
  parallel_for(0, t * kv_heads, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t r = i / kv_heads, h = i % kv_heads, at = (slot_mapping[r] * kv_heads + h) * rb;
      cache.pack(k + i * d, cache.k + at, d);
      cache.pack(v + i * d, cache.v + at, d);
    }
  });
}

namespace attn = runlm::attention;

// attention::row over packed caches: each context row unpacked once into kb ([D] scratch).
inline void row(const attn::Args& a, const Cache& c, int64_t t, int64_t kvh, int64_t p, const int64_t* slots,
                float* scores, float* acc, float* kb, float* inv) {
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
  const int64_t L = p - lo + 1, rb = c.bytes(a.D);
  const float* q = a.q + (t * a.H + kvh * a.G) * a.D;
  for (int64_t j = 0; j < L; ++j) {
    c.unpack(c.k + (slots[lo + j] * a.KVH + kvh) * rb, kb, a.D);
    for (int64_t g = 0; g < a.G; ++g) scores[g * L + j] = attn::dot(a, q + g * a.D, kb) * a.scale;
  }
  attn::softmax(a, scores, L, inv, kvh);
  std::fill(acc, acc + a.G * a.D, 0.0f);
  for (int64_t j = 0; j < L; ++j) {
    c.unpack(c.v + (slots[lo + j] * a.KVH + kvh) * rb, kb, a.D);
    for (int64_t g = 0; g < a.G; ++g) {
      const __m256 w = _mm256_set1_ps(scores[g * L + j]);
      float* o = acc + g * a.D;
      int64_t d = 0;
      for (; d + 8 <= a.D; d += 8)
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(kb + d), _mm256_loadu_ps(o + d)));
      for (; d < a.D; ++d) o[d] = std::fma(scores[g * L + j], kb[d], o[d]);
    }
  }
  for (int64_t g = 0; g < a.G; ++g) {
    float* dst = a.out + (t * a.H + kvh * a.G + g) * a.D;
    for (int64_t d = 0; d < a.D; ++d) dst[d] = acc[g * a.D + d] * inv[g];
  }
}

// attention::paged_attention over packed caches (same rows, same split of work across threads).
inline void paged_attention(const float* q, const Cache& cache, const int64_t* slots, const attn::RowPlan& plan,
                            int64_t T, int64_t H, int64_t KVH, int64_t D, float scale, int64_t window, float softcap,
                            float* out, const float* sinks = nullptr) {
  const int64_t G = H / KVH, max_len = plan.max_len;
  const attn::Args a{q, nullptr, nullptr, slots, out, H, KVH, D, G, D / 8 * 8, attn::first_lanes(D % 8), scale, window,
                     softcap, sinks};
  parallel_for(0, T * KVH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(G * max_len), acc(G * D), kb(D), inv(G);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / KVH, kvh = i % KVH;
      const int64_t row_t = (r % 2 == 0) ? r / 2 : T - 1 - r / 2;
      row(a, cache, row_t, kvh, plan.pos[row_t], slots + plan.slot0[row_t], scores.data(), acc.data(), kb.data(),
          inv.data());
    }
  });
}

}  // namespace runlm::kv_q8
