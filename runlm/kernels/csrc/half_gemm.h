// GEMM for half-precision weights (BF16, F16: a safetensors checkpoint's matrices as stored) times
// activation rows rounded to the same type (ggml's vec_dot_type for both, so llama.cpp's numerics
// class), AVX2 + F16C: decode and prefill, one kernel.
//
// ggml's vec_dot widens both rows of one (weight row, activation row) pair per call, so at prefill
// every weight value is widened once per activation row. Here a tile of 4 weight rows and 2
// activation rows shares each widened 8-value step: 6 conversions feed 8 multiply-adds (vec_dot: 2
// feed 1), and the 4 weight rows stay in cache while every activation row passes over them.
//
// Batch invariance: y[m, n] gets the same operations whatever tile it lands in and whatever M is:
// lane j accumulates fma(w[i], x[i], acc) over i = j (mod 8) in order, the 8 lanes are summed in a
// fixed tree, then the K % 8 tail is added in order.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace halfgemm {

constexpr int kTileN = 4;  // weight rows per tile
constexpr int kTileM = 2;  // activation rows per tile

struct BF16 {
  static __m256 load8(const uint16_t* p) {  // bf16 is fp32's upper half
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  }
  static float one(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};

struct F16 {
  static __m256 load8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static float one(uint16_t h) { return _cvtsh_ss(h); }
};

inline float hsum(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// y[r, c] for the tile's TN weight rows w[c] and TM activation rows x[r] (K values each).
template <class T, int TN, int TM>
inline void tile(const uint16_t* const* w, const uint16_t* const* x, int64_t k, float* const* y) {
  __m256 acc[TM][TN];
  for (int r = 0; r < TM; ++r)
    for (int c = 0; c < TN; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t k8 = k - k % 8;
  for (int64_t i = 0; i < k8; i += 8) {
    __m256 wv[TN];
    for (int c = 0; c < TN; ++c) wv[c] = T::load8(w[c] + i);
    for (int r = 0; r < TM; ++r) {
      const __m256 xv = T::load8(x[r] + i);
      for (int c = 0; c < TN; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < TM; ++r)
    for (int c = 0; c < TN; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t i = k8; i < k; ++i) s += T::one(w[c][i]) * T::one(x[r][i]);
      y[r][c] = s;
    }
}

// The tiles of rows [n0, n1) of one weight against all m activation rows, for any count of each.
template <class T, int TN>
inline void rows_of(const uint8_t* w, int64_t wstride, const uint8_t* x, int64_t xstride, int64_t m, int64_t k,
                    float* y, int64_t ldy, int64_t n) {
  const uint16_t* wr[TN];
  for (int c = 0; c < TN; ++c) wr[c] = reinterpret_cast<const uint16_t*>(w + (n + c) * wstride);
  float out[kTileM][TN];
  float* outp[kTileM] = {out[0], out[1]};
  int64_t r = 0;
  for (; r + kTileM <= m; r += kTileM) {
    const uint16_t* xr[kTileM];
    for (int j = 0; j < kTileM; ++j) xr[j] = reinterpret_cast<const uint16_t*>(x + (r + j) * xstride);
    tile<T, TN, kTileM>(wr, xr, k, outp);
    for (int j = 0; j < kTileM; ++j) std::memcpy(y + (r + j) * ldy + n, out[j], sizeof(float) * TN);
  }
  for (; r < m; ++r) {
    const uint16_t* xr[1] = {reinterpret_cast<const uint16_t*>(x + r * xstride)};
    tile<T, TN, 1>(wr, xr, k, outp);
    std::memcpy(y + r * ldy + n, out[0], sizeof(float) * TN);
  }
}

// y[:, n0 : n1] = x [m, K] @ w[n0 : n1]^T for half rows of K values (ggml_linear's BlockRows
// signature: `blocks` is K for these one-value-block types; block sums and the zero row are unused).
template <class T>
void rows(const uint8_t* w, int64_t wstride, const uint8_t* x, int64_t xstride, const int32_t* /*block_sums*/,
          int64_t m, int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1, const uint8_t* /*zero_row*/) {
  int64_t n = n0;
  for (; n + kTileN <= n1; n += kTileN) rows_of<T, kTileN>(w, wstride, x, xstride, m, k, y, ldy, n);
  for (; n < n1; ++n) rows_of<T, 1>(w, wstride, x, xstride, m, k, y, ldy, n);
}

}  // namespace halfgemm
