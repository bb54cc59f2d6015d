// Integer GEMM for the K-quants (Q4_K, Q5_K, Q6_K: 256-value superblocks) with Q8_K activations,
// AVX2 + F16C. The same scheme as block_gemm.h, one level up: a superblock of 8 weight rows is
// unpacked once into unsigned bytes and 16-value integer scales, transposed so that lane r holds
// row r, and then multiplied into every activation row of a chunk (prefill, batches); a lone
// activation row (decode) takes each weight row's dot product directly and sums across lanes.
//
// Per (weight row, activation row) and superblock the arithmetic is exact integers:
//   dot  = sum over 16-value groups g of scale_g * sum(q * x)      (q unsigned, x int8)
//   corr = sum over g of corr_g * bsum_g                            (bsum_g: the group's sum of x)
// Q6_K (value q - 32): dot -= corr with corr_g = 32 * scale_g, then acc = fma(d_w * d_x, dot, acc).
// Q4_K/Q5_K (value scale * q - min): acc = fma(d_w * d_x, dot, acc), then
// acc = fnmadd(dmin_w * d_x, corr, acc) with corr_g = min_g. The order of integer sums does not
// change them, so every path (panel, row, any M, any thread count) gives every output the same bits.
#pragma once

#include "block_gemm.h"

namespace kquant {

using blockgemm::fp16;
using blockgemm::kChunk;
using blockgemm::kPanel;

constexpr int QK_K = 256;
// Chunks of at most this many activation rows take panel_row per row: unpacking and transposing
// a superblock panel costs about what 4-6 rows of products do (bench/quant_gemm_bench.py, M = 4).
constexpr int kRowwise = 4;
constexpr int kGroups = QK_K / 16;

struct BlockQ8_K { float d; int8_t qs[QK_K]; int16_t bsums[kGroups]; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
struct BlockQ6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[kGroups]; uint16_t d; };
static_assert(sizeof(BlockQ8_K) == 292 && sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 &&
                  sizeof(BlockQ6_K) == 210,
              "ggml block layouts");

// One weight row's superblock: values as unsigned bytes in order, per 16-value group its scale and
// correction weight (int16), the float scales.
struct Unpacked {
  alignas(32) uint8_t q[QK_K];
  int16_t scale[kGroups];
  int16_t corr[kGroups];
  float d, dmin;
};

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store32(uint8_t* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }

// Q4_K/Q5_K's 12 bytes of 6-bit scales and mins as 16 int16: scales 0..7 then mins 0..7 (ggml's utmp trick).
inline __m256i scales_mins16(const uint8_t* s) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  constexpr uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
  const uint32_t mins_lo = u[1] & m1;
  u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
  u[2] = mins_lo;
  u[0] &= m1;
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u)));
}

// Byte mask selecting 16-bit element j of each 128-bit half, in every 16-bit lane.
inline __m256i element16(int j) { return _mm256_set1_epi16(static_cast<int16_t>((2 * j) | ((2 * j + 1) << 8))); }

// 16-bit element j of a 128-bit vector, in every 16-bit lane of a 256-bit one.
inline __m256i spread16(__m128i v, int j) { return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(v), element16(j)); }

// The 8 mins (int16, in the high half of scales_mins16) times the sums of x's 32-value sub-blocks.
inline __m256i min_corr(__m256i sm, const BlockQ8_K& xb) {
  const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb.bsums)),
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb.bsums + 8)));
  return _mm256_zextsi128_si256(_mm_madd_epi16(_mm256_extracti128_si256(sm, 1), bs));
}

// The 6-bit scales and mins of Q4_K/Q5_K per 16-value group (each 32-value sub-block's, twice).
inline void scales_mins_k4(const uint8_t* s, Unpacked& u) {
  const __m256i sm = scales_mins16(s);
  const __m128i sc = _mm256_castsi256_si128(sm), mn = _mm256_extracti128_si256(sm, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(u.scale), _mm_unpacklo_epi16(sc, sc));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(u.scale + 8), _mm_unpackhi_epi16(sc, sc));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(u.corr), _mm_unpacklo_epi16(mn, mn));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(u.corr + 8), _mm_unpackhi_epi16(mn, mn));
}

// Q4_K and Q5_K: 4-bit values (Q5_K adds a fifth bit from qh), a scale and a min per 32 values.
template <class B, bool kFifth>
struct K4 {
  using Block = B;
  static constexpr bool kCorrInDot = false;
  // steps of 4 values summed in int16 before the scale: 2 x 2 x 31 x 127 (Q5_K) and 8 x 2 x 15 x 127 (Q4_K) fit;
  // Q4_K's 8 steps cover both 16-value groups of a 32-value sub-block, which share its scale
  static constexpr int kInt16Steps = kFifth ? 2 : 8;
  static constexpr int kScaleSteps = 8;  // steps of 4 values under one scale (a 32-value sub-block)

  // Values 64p .. 64p + 31 (low nibbles of qs[32p..]) and 64p + 32 .. 64p + 63 (high nibbles).
  static void values(const Block& b, int p, __m256i& v0, __m256i& v1) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i v = load32(b.qs + 32 * p);
    v0 = _mm256_and_si256(v, low);
    v1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if constexpr (kFifth) {  // bit 2p of qh[l] adds 16 to value 64p + l, bit 2p + 1 to value 64p + 32 + l
      const __m256i hi = load32(b.qh), bit = _mm256_set1_epi8(0x10);
      v0 = _mm256_or_si256(v0, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hi, 2 * p), 4), bit));
      v1 = _mm256_or_si256(v1, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hi, 2 * p + 1), 4), bit));
    }
  }
  static void unpack(const Block& b, Unpacked& u) {
    for (int p = 0; p < 4; ++p) {
      __m256i v0, v1;
      values(b, p, v0, v1);
      store32(u.q + 64 * p, v0);
      store32(u.q + 64 * p + 32, v1);
    }
    scales_mins_k4(b.scales, u);
    u.d = fp16(b.d);
    u.dmin = fp16(b.dmin);
  }
  static uint16_t dmin(const Block& b) { return b.dmin; }
  static void row_dot(const Block& b, const BlockQ8_K& xb, __m256i& dot, __m256i& corr) {
    const __m256i sm = scales_mins16(b.scales);
    const __m128i sc = _mm256_castsi256_si128(sm);
    const uint8_t* xq = reinterpret_cast<const uint8_t*>(xb.qs);
    dot = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      __m256i v0, v1;
      values(b, p, v0, v1);
      const __m256i p0 = _mm256_maddubs_epi16(v0, load32(xq + 64 * p));
      const __m256i p1 = _mm256_maddubs_epi16(v1, load32(xq + 64 * p + 32));
      dot = blockgemm::madd_add(blockgemm::madd_add(dot, p0, spread16(sc, 2 * p)), p1, spread16(sc, 2 * p + 1));
    }
    corr = min_corr(sm, xb);
  }
};
using Q4_K = K4<BlockQ4_K, false>;
using Q5_K = K4<BlockQ5_K, true>;

struct Q6_K {
  using Block = BlockQ6_K;
  static constexpr bool kCorrInDot = true;
  static constexpr int kInt16Steps = 2;  // 2 steps x 2 x 63 x 127 fits int16
  static constexpr int kScaleSteps = 4;  // a scale per 16 values
  static void unpack(const Block& b, Unpacked& u) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {  // each half: 64 bytes of low nibbles, 32 bytes of 2-bit highs
      const __m256i l0 = load32(b.ql + 64 * h), l1 = load32(b.ql + 64 * h + 32), hb = load32(b.qh + 32 * h);
      uint8_t* q = u.q + 128 * h;
      store32(q, _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), two)));
      store32(q + 32, _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), two)));
      store32(q + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(hb, two)));
      store32(q + 96,
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), _mm256_and_si256(_mm256_srli_epi16(hb, 2), two)));
    }
    for (int g = 0; g < kGroups; ++g) {
      u.scale[g] = b.scales[g];
      u.corr[g] = static_cast<int16_t>(32 * b.scales[g]);
    }
    u.d = fp16(b.d);
    u.dmin = u.d;
  }
  static uint16_t dmin(const Block& b) { return b.d; }
  static void row_dot(const Block& b, const BlockQ8_K& xb, __m256i& dot, __m256i& corr) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)));
    // chunk c of 32 values: groups 2c (low 128 bits of the product) and 2c + 1 (high), whose scales
    // are 16-bit elements 2c % 8 and 2c % 8 + 1 of half c / 4 of sc16
    const __m256i halves[2] = {_mm256_permute2x128_si256(sc16, sc16, 0x00), _mm256_permute2x128_si256(sc16, sc16, 0x11)};
    dot = _mm256_setzero_si256();
    const uint8_t* xq = reinterpret_cast<const uint8_t*>(xb.qs);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(b.ql + 64 * h), l1 = load32(b.ql + 64 * h + 32), hb = load32(b.qh + 32 * h);
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), two)),
          _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), two)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(hb, two)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), _mm256_and_si256(_mm256_srli_epi16(hb, 2), two))};
      for (int c = 0; c < 4; ++c) {
        const int chunk = 4 * h + c;
        const __m256i p = _mm256_maddubs_epi16(q[c], load32(xq + 32 * chunk));
        const __m256i mask = _mm256_set_m128i(_mm256_castsi256_si128(element16(2 * c + 1)),
                                              _mm256_castsi256_si128(element16(2 * c)));
        dot = blockgemm::madd_add(dot, p, _mm256_shuffle_epi8(halves[h], mask));
      }
    }
    corr = _mm256_madd_epi16(_mm256_slli_epi16(sc16, 5),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums)));
  }
};


// The float step shared by every path: lanes are the 8 weight rows.
template <class W>
inline __m256 accumulate(__m256 acc, __m256 dw, __m256 dminw, float dx, __m256i dot, __m256i corr) {
  const __m256 x = _mm256_set1_ps(dx);
  if constexpr (W::kCorrInDot) return _mm256_fmadd_ps(_mm256_mul_ps(dw, x), _mm256_cvtepi32_ps(_mm256_sub_epi32(dot, corr)), acc);
  acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, x), _mm256_cvtepi32_ps(dot), acc);
  return _mm256_fnmadd_ps(_mm256_mul_ps(dminw, x), _mm256_cvtepi32_ps(corr), acc);
}

template <class W>
inline void unpack_panel(const uint8_t* const* wrow, int64_t sb, Unpacked* u, __m256& dw, __m256& dminw) {
  alignas(32) float d[kPanel], dmin[kPanel];
  for (int r = 0; r < kPanel; ++r) {
    W::unpack(reinterpret_cast<const typename W::Block*>(wrow[r])[sb], u[r]);
    d[r] = u[r].d;
    dmin[r] = u[r].dmin;
  }
  dw = _mm256_load_ps(d);
  dminw = _mm256_load_ps(dmin);
}

// Chunk of activation rows against a panel of 8 weight rows.
template <class W>
void panel(const uint8_t* const* wrow, int64_t ws, const uint8_t* x, int64_t xs, const int32_t*, int64_t nsb, int mc,
           float* y, int64_t ldy, int nvalid) {
  __m256 acc[kChunk];
  for (int i = 0; i < mc; ++i) acc[i] = _mm256_setzero_ps();
  Unpacked u[kPanel];
  __m256i dots[kChunk];
  __m256i corr[kPanel];  // lane r = (corr_2c, corr_2c+1) of row r
  for (int64_t sb = 0; sb < nsb; ++sb) {
    blockgemm::prefetch_next_panel<typename W::Block>(wrow[0], ws, sb);
    __m256 dw, dminw;
    unpack_panel<W>(wrow, sb, u, dw, dminw);
    // 16 int16 per row, read as 8 pairs and transposed: vector c, lane r = (v_r[2c], v_r[2c + 1])
    __m256i scale_pairs[kPanel];
    for (int r = 0; r < kPanel; ++r) {
      scale_pairs[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u[r].scale));
      corr[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u[r].corr));
    }
    blockgemm::transpose8(scale_pairs);
    blockgemm::transpose8(corr);
    for (int i = 0; i < mc; ++i) dots[i] = _mm256_setzero_si256();
    for (int c = 0; c < QK_K / 32; ++c) {  // 32 values (groups 2c and 2c + 1) of 8 rows, in registers
      __m256i t[kPanel];  // step s: lane r = values 32c + 4s .. + 3 of row r
      for (int r = 0; r < kPanel; ++r) t[r] = load32(u[r].q + 32 * c);
      blockgemm::transpose8(t);
#ifdef RUNLM_VNNI
      // lane r = row r's scale as int32, for groups 2c and 2c + 1 (the int16 pairs' low and high halves)
      const __m256i scale32[2] = {_mm256_srai_epi32(_mm256_slli_epi32(scale_pairs[c], 16), 16),
                                  _mm256_srai_epi32(scale_pairs[c], 16)};
      for (int i = 0; i < mc; ++i) {
        const int8_t* xq = reinterpret_cast<const BlockQ8_K*>(x + i * xs)[sb].qs + 32 * c;
        __m256i dot = dots[i];
        for (int s0 = 0; s0 < kPanel; s0 += W::kScaleSteps) {
          __m256i a = blockgemm::dpbusd(_mm256_setzero_si256(), t[s0], blockgemm::broadcast4(xq + 4 * s0));
          for (int s = s0 + 1; s < s0 + W::kScaleSteps; ++s) a = blockgemm::dpbusd(a, t[s], blockgemm::broadcast4(xq + 4 * s));
          dot = _mm256_add_epi32(dot, _mm256_mullo_epi32(a, scale32[s0 / 4]));
        }
        dots[i] = dot;
      }
#else
      const __m256i scale[2] = {  // lane r = (scale, scale) of row r, for groups 2c and 2c + 1
          _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(scale_pairs[c], 0xA0), 0xA0),
          _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(scale_pairs[c], 0xF5), 0xF5)};
      for (int i = 0; i < mc; ++i) {
        const int8_t* xq = reinterpret_cast<const BlockQ8_K*>(x + i * xs)[sb].qs + 32 * c;
        __m256i dot = dots[i];
        for (int s0 = 0; s0 < kPanel; s0 += W::kInt16Steps) {
          __m256i p = _mm256_maddubs_epi16(t[s0], blockgemm::broadcast4(xq + 4 * s0));
          for (int s = s0 + 1; s < s0 + W::kInt16Steps; ++s)
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(t[s], blockgemm::broadcast4(xq + 4 * s)));
          dot = blockgemm::madd_add(dot, p, scale[s0 / 4]);  // (8 steps: group 2c's = 2c + 1's)
        }
        dots[i] = dot;
      }
#endif
    }
    for (int i = 0; i < mc; ++i) {
      const BlockQ8_K& xb = reinterpret_cast<const BlockQ8_K*>(x + i * xs)[sb];
      __m256i cs = _mm256_setzero_si256();
      for (int c = 0; c < kGroups / 2; ++c)
        cs = blockgemm::madd_add(cs, corr[c], blockgemm::broadcast4(reinterpret_cast<const int8_t*>(xb.bsums + 2 * c)));
      acc[i] = accumulate<W>(acc[i], dw, dminw, xb.d, dots[i], cs);
    }
  }
  for (int i = 0; i < mc; ++i) {
    alignas(32) float lanes[kPanel];
    _mm256_store_ps(lanes, acc[i]);
    std::memcpy(y + i * ldy, lanes, sizeof(float) * nvalid);
  }
}

// One activation row against a panel (decode): each weight row's integer sums straight from its
// block (W::row_dot, no unpacking to memory) as 8 lanes, then summed across lanes (exact) into lane r.
template <class W>
void panel_row(const uint8_t* const* wrow, int64_t ws, const uint8_t* x, const int32_t*, int64_t nsb, float* y,
               int nvalid) {
  using Block = typename W::Block;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    blockgemm::prefetch_next_panel<Block, _MM_HINT_T1>(wrow[0], ws, sb);
    const BlockQ8_K& xb = reinterpret_cast<const BlockQ8_K*>(x)[sb];
    __m256i dots[kPanel], corrs[kPanel];
    __m128i hd = _mm_setzero_si128(), hm = _mm_setzero_si128();  // registers, not stack arrays: 8 small stores
    for (int r = 0; r < kPanel; ++r) {  // then one wide load would stall on store forwarding (block_gemm.h too)
      const Block& blk = reinterpret_cast<const Block*>(wrow[r])[sb];
      W::row_dot(blk, xb, dots[r], corrs[r]);
      hd = blockgemm::insert16(hd, blk.d, r);
      if constexpr (!W::kCorrInDot) hm = blockgemm::insert16(hm, W::dmin(blk), r);
    }
    const __m256 d = _mm256_cvtph_ps(hd);
    acc = accumulate<W>(acc, d, W::kCorrInDot ? d : _mm256_cvtph_ps(hm), xb.d, blockgemm::reduce8(dots),
                        blockgemm::reduce8(corrs));
  }
  alignas(32) float lanes[kPanel];
  _mm256_store_ps(lanes, acc);
  std::memcpy(y, lanes, sizeof(float) * nvalid);
}

template <class W>
constexpr auto rows = blockgemm::drive<kRowwise, &panel<W>, &panel_row<W>>;

}  // namespace kquant
