// Q4_K and Q6_K weights repacked once at load into panels of 8 rows ("x8"), for the native runner's decoder: the
// layout kquant::panel() builds for every superblock on every call (8 rows' values transposed so that 32-bit lane
// r holds row r's) is built once, so a call only loads, masks and multiplies. llama.cpp's CPU "repack" buffers
// (block_q4_Kx8) do the same. On a 2-core AMD EPYC (AVX2, no VNNI), against kquant::rows on the same Q4_K rows: a
// decode row 2.3x as fast with the weights in cache, 1.3x from DRAM at 2 threads, where the K-quant kernels had been
// compute-bound (a 1.5B-shaped file's Q8_0 matrices streamed 17.5 GB/s, its Q4_K_M's ~12). That file's decode went
// from 10.1 to 14.0 tok/s with Q4_K and Q6_K packed (bench/quant_bench.py).
//
// A packed superblock (one per panel and superblock, panels in order, each panel's superblocks in order):
//   d[8], dmin[8]   the 8 rows' fp16 scales, as stored
//   sc[j][r], mn[j][r]  row r's 6-bit scale and min of 32-value sub-block j (ggml's get_scale_min_k4, decoded)
//   qs[j][t][4r + i]    row r's values 32j + 8t + i (low nibble) and 32j + 8t + 4 + i (high nibble), i < 4
// 1184 bytes for the 8 x 144 of the rows as stored (+2.8%). Rows past the weight's end are zero rows.
//
// Arithmetic: per (weight row, activation row) and superblock the same exact integers as kquant_gemm.h's Q4_K
// (dot = sum_j scale_j * sum(q x), corr = sum_j min_j * bsum_j; int16 partial sums of one sub-block's 32 products
// bounded by 8 x 2 x 15 x 128 < 2^15), then the same acc = fma(d_w d_x, dot, acc), fnmadd(dmin_w d_x, corr, acc)
// in superblock order: every output is kquant::rows<Q4_K>'s bits, for any M, panel or thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kquant_gemm.h"

namespace kquant::packed {

// Superblocks a call looks ahead in its stream of packed superblocks (one linear run per thread: the hardware
// prefetcher follows it, but not far enough ahead to keep two cores' loads in flight).
constexpr int kAhead = 2;

inline int64_t panels(int64_t rows) { return (rows + kPanel - 1) / kPanel; }

// Lane r = v[r] from 8 unsigned bytes.
inline __m256i widen8(const uint8_t* v) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v)));
}

// Lane r = (v[r], v[r]) as two int16 from 8 bytes (unsigned, or signed and times `times`).
inline __m256i pairs8(const uint8_t* v) {
  const __m256i w = widen8(v);
  return _mm256_or_si256(w, _mm256_slli_epi32(w, 16));
}
inline __m256i signed_pairs8(const int8_t* v, int times) {
  const __m256i w = _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))),
                                       _mm256_set1_epi32(times));
  return _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(w, 16));
}

// Panels [p0, p1) of a [rows, nsb blocks] weight into P's packed superblocks (out: the whole packed weight,
// panels(rows) x nsb of them): P::put(o, block, r) writes row r's block into superblock o.
template <class P>
inline void pack(const uint8_t* w, int64_t ws, int64_t rows, int64_t nsb, int64_t p0, int64_t p1, P* out) {
  using Block = typename P::Block;
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t sb = 0; sb < nsb; ++sb) {
      P& o = out[p * nsb + sb];
      const int nrows = static_cast<int>(std::min<int64_t>(kPanel, rows - p * kPanel));
      if (nrows < kPanel) std::memset(&o, 0, sizeof(o));  // rows past the weight's end: zero rows
      for (int r = 0; r < nrows; ++r) P::put(o, reinterpret_cast<const Block*>(w + (p * kPanel + r) * ws)[sb], r);
    }
}

// The blockgemm::drive kernel signature on P's packed superblocks (w: the packed weight; ws and zero_row unused):
// output columns [n0, n1) of y for m activation rows (Q8_K), n0 a panel boundary. P::step adds one superblock of a
// panel into each activation row's 8 accumulators.
template <class P>
inline void rows(const uint8_t* w, int64_t, const uint8_t* x, int64_t xs, const int32_t*, int64_t m, int64_t nsb,
                 float* y, int64_t ldy, int64_t n0, int64_t n1, const uint8_t*) {
  const P* packed = reinterpret_cast<const P*>(w);
  for (int64_t m0 = 0; m0 < m; m0 += kChunk) {
    const int mc = static_cast<int>(m - m0 < kChunk ? m - m0 : kChunk);
    for (int64_t n = n0; n < n1; n += kPanel) {
      const P* panel = packed + n / kPanel * nsb;
      __m256 acc[kChunk];
      for (int i = 0; i < mc; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t sb = 0; sb < nsb; ++sb) {
        for (int l = 0; l < static_cast<int>(sizeof(P)); l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(panel + sb + kAhead) + l, _MM_HINT_T0);
        P::step(panel[sb], x + m0 * xs, xs, sb, mc, acc);
      }
      const int nvalid = static_cast<int>(n1 - n < kPanel ? n1 - n : kPanel);
      for (int i = 0; i < mc; ++i) {
        alignas(32) float lanes[kPanel];
        _mm256_store_ps(lanes, acc[i]);
        std::memcpy(y + (m0 + i) * ldy + n, lanes, sizeof(float) * nvalid);
      }
    }
  }
}

inline const BlockQ8_K& x_block(const uint8_t* x, int64_t xs, int i, int64_t sb) {
  return reinterpret_cast<const BlockQ8_K*>(x + i * xs)[sb];
}

struct Q4_Kx8 {
  using Block = BlockQ4_K;
  uint16_t d[kPanel], dmin[kPanel];
  uint8_t sc[8][kPanel], mn[8][kPanel];
  uint8_t qs[8][4][32];

  static void put(Q4_Kx8& o, const Block& b, int r) {
    o.d[r] = b.d;
    o.dmin[r] = b.dmin;
    alignas(16) uint8_t sm[16];  // scales 0..7, mins 0..7 (each < 64)
    const __m256i sm16 = scales_mins16(b.scales);
    _mm_store_si128(reinterpret_cast<__m128i*>(sm),
                    _mm_packus_epi16(_mm256_castsi256_si128(sm16), _mm256_extracti128_si256(sm16, 1)));
    for (int j = 0; j < 8; ++j) o.sc[j][r] = sm[j], o.mn[j][r] = sm[8 + j];
    for (int j = 0; j < 8; ++j) {  // sub-block j: the low (j even) or high (j odd) nibbles of qs[32 (j / 2) ...]
      uint32_t v[8];               // v[u]: values 32j + 4u .. + 3, one a byte
      std::memcpy(v, b.qs + 32 * (j / 2), 32);
      for (uint32_t& word : v) word = (j % 2 == 0 ? word : word >> 4) & 0x0F0F0F0F;
      for (int t = 0; t < 4; ++t) {  // each byte < 16: the shift moves every value into its byte's high nibble
        const uint32_t word = v[2 * t] | (v[2 * t + 1] << 4);
        std::memcpy(o.qs[j][t] + 4 * r, &word, 4);
      }
    }
  }

  static void step(const Q4_Kx8& b, const uint8_t* x, int64_t xs, int64_t sb, int mc, __m256* acc) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i dots[kChunk];
    for (int i = 0; i < mc; ++i) dots[i] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i q[8];  // q[2t], q[2t + 1]: values 8t .. + 3 and 8t + 4 .. + 7 of sub-block j, lane r = row r
      for (int t = 0; t < 4; ++t) {
        const __m256i v = load32(b.qs[j][t]);
        q[2 * t] = _mm256_and_si256(v, low);
        q[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const __m256i scale = pairs8(b.sc[j]);
      for (int i = 0; i < mc; ++i) {
        const int8_t* xq = x_block(x, xs, i, sb).qs + 32 * j;
        __m256i a = _mm256_maddubs_epi16(q[0], blockgemm::broadcast4(xq));
        for (int s = 1; s < 8; ++s)
          a = _mm256_add_epi16(a, _mm256_maddubs_epi16(q[s], blockgemm::broadcast4(xq + 4 * s)));
        dots[i] = blockgemm::madd_add(dots[i], a, scale);
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.d)));
    const __m256 dminw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.dmin)));
    __m256i mins[4];  // lane r = (min_2u, min_2u+1) of row r
    for (int u = 0; u < 4; ++u)
      mins[u] = _mm256_or_si256(widen8(b.mn[2 * u]), _mm256_slli_epi32(widen8(b.mn[2 * u + 1]), 16));
    for (int i = 0; i < mc; ++i) {
      const BlockQ8_K& xb = x_block(x, xs, i, sb);
      // the 8 sub-blocks' sums of x as int16 pairs (sub-block j: bsums 2j and 2j + 1; |sum| <= 32 x 128)
      const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb.bsums)),
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb.bsums + 8)));
      __m256i corr = _mm256_setzero_si256();
      for (int u = 0; u < 4; ++u)
        corr = blockgemm::madd_add(corr, mins[u], _mm256_set1_epi32(_mm_extract_epi32(bs, u)));
      acc[i] = accumulate<Q4_K>(acc[i], dw, dminw, xb.d, dots[i], corr);
    }
  }
};
static_assert(sizeof(Q4_Kx8) == 1184, "packed Q4_K layout");

// Q6_K in the same panels ("Q6_K x8", 8 x 210 bytes: the rows' own size). Per panel and superblock:
//   d[8]                the 8 rows' fp16 scales, as stored
//   sc[g][r]            row r's int8 scale of 16-value group g
//   ql[j][t][4r + i]    row r's low 4 bits of values 32j + 8t + i (low nibble) and 32j + 8t + 4 + i (high nibble)
//   qh[j][k][4r + i]    row r's high 2 bits of values 32j + 16k + 4s + i at bits 2s, 2s + 1 (s < 4)
// The arithmetic of kquant_gemm.h's Q6_K: dot = sum_g scale_g * sum(q x) with q in 0..63 (int16 sums of two
// steps: 2 x 2 x 63 x 128 < 2^15), corr = 32 sum_g scale_g * bsum_g, acc = fma(d_w d_x, dot - corr, acc).
struct Q6_Kx8 {
  using Block = BlockQ6_K;
  uint16_t d[kPanel];
  int8_t sc[16][kPanel];
  uint8_t ql[8][4][32];
  uint8_t qh[8][2][32];

  static void put(Q6_Kx8& o, const Block& b, int r) {
    o.d[r] = b.d;
    for (int g = 0; g < 16; ++g) o.sc[g][r] = b.scales[g];
    Unpacked u;  // the 256 values in order, 0..63
    Q6_K::unpack(b, u);
    for (int j = 0; j < 8; ++j) {
      uint32_t v[8];  // v[s]: values 32j + 4s .. + 3, one a byte
      std::memcpy(v, u.q + 32 * j, 32);
      for (int t = 0; t < 4; ++t) {
        const uint32_t word = (v[2 * t] & 0x0F0F0F0F) | ((v[2 * t + 1] & 0x0F0F0F0F) << 4);
        std::memcpy(o.ql[j][t] + 4 * r, &word, 4);
      }
      for (int k = 0; k < 2; ++k) {  // each byte's two high bits, four steps to a byte
        uint32_t word = 0;
        for (int st = 0; st < 4; ++st) word |= ((v[4 * k + st] >> 4) & 0x03030303) << (2 * st);
        std::memcpy(o.qh[j][k] + 4 * r, &word, 4);
      }
    }
  }

  static void step(const Q6_Kx8& b, const uint8_t* x, int64_t xs, int64_t sb, int mc, __m256* acc) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    __m256i dots[kChunk];
    for (int i = 0; i < mc; ++i) dots[i] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i q[8];  // step s: values 32j + 4s .. + 3, lane r = row r, 0..63
      for (int t = 0; t < 4; ++t) {
        const __m256i v = load32(b.ql[j][t]);
        q[2 * t] = _mm256_and_si256(v, low);
        q[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int k = 0; k < 2; ++k) {  // bits 2s, 2s + 1 of qh[j][k] to bits 4, 5 of step 4k + s
        const __m256i h = load32(b.qh[j][k]);
        q[4 * k] = _mm256_or_si256(q[4 * k], _mm256_and_si256(_mm256_slli_epi16(h, 4), two));
        q[4 * k + 1] = _mm256_or_si256(q[4 * k + 1], _mm256_and_si256(_mm256_slli_epi16(h, 2), two));
        q[4 * k + 2] = _mm256_or_si256(q[4 * k + 2], _mm256_and_si256(h, two));
        q[4 * k + 3] = _mm256_or_si256(q[4 * k + 3], _mm256_and_si256(_mm256_srli_epi16(h, 2), two));
      }
      const __m256i scale[2] = {signed_pairs8(b.sc[2 * j], 1), signed_pairs8(b.sc[2 * j + 1], 1)};
      for (int i = 0; i < mc; ++i) {
        const int8_t* xq = x_block(x, xs, i, sb).qs + 32 * j;
        __m256i dot = dots[i];
        for (int s = 0; s < 8; s += 2) {
          const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(q[s], blockgemm::broadcast4(xq + 4 * s)),
                                             _mm256_maddubs_epi16(q[s + 1], blockgemm::broadcast4(xq + 4 * s + 4)));
          dot = blockgemm::madd_add(dot, a, scale[s / 4]);
        }
        dots[i] = dot;
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.d)));
    __m256i sc32[8];  // lane r = 32 (scale_2u, scale_2u+1) of row r
    for (int u = 0; u < 8; ++u)
      sc32[u] = _mm256_or_si256(_mm256_and_si256(signed_pairs8(b.sc[2 * u], 32), _mm256_set1_epi32(0xFFFF)),
                                _mm256_slli_epi32(signed_pairs8(b.sc[2 * u + 1], 32), 16));
    for (int i = 0; i < mc; ++i) {
      const BlockQ8_K& xb = x_block(x, xs, i, sb);
      __m256i corr = _mm256_setzero_si256();
      for (int u = 0; u < 8; ++u) {
        int32_t pair;
        std::memcpy(&pair, xb.bsums + 2 * u, 4);
        corr = blockgemm::madd_add(corr, sc32[u], _mm256_set1_epi32(pair));
      }
      acc[i] = accumulate<Q6_K>(acc[i], dw, dw, xb.d, dots[i], corr);
    }
  }
};
static_assert(sizeof(Q6_Kx8) == kPanel * sizeof(BlockQ6_K), "packed Q6_K layout");

}  // namespace kquant::packed
