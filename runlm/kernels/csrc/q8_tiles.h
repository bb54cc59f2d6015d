// Register-tiled dot products for weights in Q8_0 or Q4_0 with Q8_0 activations (AVX2 + F16C).
//
// ggml's vec_dot computes one (weight row, activation row) pair per call, so a prefill of M rows
// loads every weight block M times. Here a tile of MR activation rows x NR weight rows shares
// each load: a weight block is unpacked once for MR rows, an activation block once for NR rows.
//
// Batch invariance: every output y[m, n] gets exactly the same operations whatever the tile it
// lands in (MR and NR only decide how many pairs run side by side): per 32-value block, the
// integer dot product of the two blocks' int8 values (sign trick + maddubs + madd, as ggml's
// AVX2 code does), converted to float and accumulated as fma(d_w * d_x, dot, acc) in block
// order; then the 8 lanes summed in one fixed tree. The decode path (M = 1) runs the same code.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace q8tiles {

constexpr int QK = 32;

struct BlockQ8_0 {
  uint16_t d;  // fp16 scale
  int8_t qs[QK];
};
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[QK / 2];  // value i: low nibble of qs[i] (i < 16) or high nibble of qs[i - 16], minus 8
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18, "ggml block layouts");

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }

inline float hsum(__m256 v) {  // the fixed combine order
  __m128 r = _mm256_extractf128_ps(v, 1);
  r = _mm_add_ps(r, _mm256_castps256_ps128(v));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// One weight block as 32 signed bytes, and its scale.
template <typename Block>
inline __m256i unpack(const Block& b);

template <>
inline __m256i unpack<BlockQ8_0>(const BlockQ8_0& b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
}

template <>
inline __m256i unpack<BlockQ4_0>(const BlockQ4_0& b) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
  const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
  return _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
}

// The integer dot product of two blocks of 32 int8, as 8 float lanes.
inline __m256 block_dot(__m256i abs_w, __m256i w, __m256i x) {
  const __m256i signed_x = _mm256_sign_epi8(x, w);
  const __m256i pairs = _mm256_maddubs_epi16(abs_w, signed_x);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// y[i * ldy + j] for MR activation rows (x, stride xs bytes) and NR weight rows (w, stride ws bytes).
template <typename Block, int MR, int NR>
inline void tile(const uint8_t* w, int64_t ws, const uint8_t* x, int64_t xs, int64_t nb, float* y, int64_t ldy) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wq[NR], wa[NR];
    float wd[NR];
    for (int j = 0; j < NR; ++j) {
      const Block& blk = reinterpret_cast<const Block*>(w + j * ws)[b];
      wq[j] = unpack<Block>(blk);
      wa[j] = _mm256_sign_epi8(wq[j], wq[j]);
      wd[j] = fp16(blk.d);
    }
    for (int i = 0; i < MR; ++i) {
      const BlockQ8_0& xb = reinterpret_cast<const BlockQ8_0*>(x + i * xs)[b];
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
      const float xd = fp16(xb.d);
      for (int j = 0; j < NR; ++j)
        acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(wd[j] * xd), block_dot(wa[j], wq[j], xq), acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum(acc[i][j]);
}

// Rows [n0, n1) of y = x @ w^T for all m rows of x: weight rows in groups of 4 (kept in L1 while
// every activation row passes), activation rows in groups of 4.
template <typename Block>
void rows(const uint8_t* w, int64_t ws, const uint8_t* x, int64_t xs, int64_t m, int64_t nb, float* y, int64_t ldy,
          int64_t n0, int64_t n1) {
  constexpr int MR = 4, NR = 4;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    const uint8_t* wr = w + n * ws;
    int64_t i = 0;
    for (; i + MR <= m; i += MR) tile<Block, MR, NR>(wr, ws, x + i * xs, xs, nb, y + i * ldy + n, ldy);
    for (; i < m; ++i) tile<Block, 1, NR>(wr, ws, x + i * xs, xs, nb, y + i * ldy + n, ldy);
  }
  for (; n < n1; ++n)
    for (int64_t i = 0; i < m; ++i) tile<Block, 1, 1>(w + n * ws, ws, x + i * xs, xs, nb, y + i * ldy + n, ldy);
}

}  // namespace q8tiles
