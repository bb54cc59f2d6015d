// Integer GEMM for 32-value block types (Q8_0, Q4_0, Q5_0 with Q8_0 activations; Q4_1, Q5_1 with
// Q8_1 activations), AVX2 + F16C: decode and prefill, one kernel.
//
// ggml's vec_dot computes one (weight row, activation row) pair per call and ends it with a
// horizontal sum. Here a panel of 8 weight rows is unpacked once per block and transposed so
// that 32-bit lane r of register s holds values 4s..4s+3 of row r; each activation row then
// broadcasts its own 4 values of step s and one maddubs multiplies them into all 8 rows at once.
// The 8 dot products land in 8 lanes: no horizontal sums, and one float multiply-add per block
// serves 8 outputs. Each activation row of a chunk reuses the unpacked panel.
//
// Batch invariance: every output y[m, n] gets the same operations whatever the chunk or panel it
// lands in and whatever M is: per block, the exact integer dot product of the two blocks (any
// summation order gives the same integer), converted to float and accumulated as
// fma(d_w * d_x, dot, acc) in block order (then + m_w * s_x for types with a minimum).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace blockgemm {

constexpr int QK = 32;
constexpr int kPanel = 8;   // weight rows unpacked together (the 8 float lanes)
constexpr int kChunk = 32;  // activation rows sharing one unpacked panel
constexpr int kRowwise = 1;  // chunks of at most this many activation rows use panel_row

struct BlockQ8_0 { uint16_t d; int8_t qs[QK]; };
struct BlockQ8_1 { uint16_t d, s; int8_t qs[QK]; };  // s = d * sum(qs) in fp16 (not used: see x_sum)
struct BlockQ4_0 { uint16_t d; uint8_t qs[QK / 2]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[QK / 2]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; };
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ8_1) == 36 && sizeof(BlockQ4_0) == 18 &&
                  sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24,
              "ggml block layouts");

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }

// Value i of a 4-bit block: low nibble of qs[i] (i < 16) or high nibble of qs[i - 16], 0..15.
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// Bit i of the 32-bit qh as 0x10 in byte i (the fifth bit of a 5-bit value).
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                        _mm256_set1_epi64x(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Per weight type: its block, the activation block it pairs with, and its 32 values as bytes
// (signed for Q8_0; unsigned q for the others, whose real value is q - kOffset, or d*q + m).
struct Q8_0 {
  using Block = BlockQ8_0;
  using X = BlockQ8_0;
  static constexpr bool kSigned = true, kMin = false;
  static constexpr int kOffset = 0, kInt16Steps = 1;
  static __m256i unpack(const Block& b) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs)); }
};
struct Q4_0 {
  using Block = BlockQ4_0;
  using X = BlockQ8_0;
  static constexpr bool kSigned = false, kMin = false;
  static constexpr int kOffset = 8, kInt16Steps = 8;  // 8 steps x 2 x 15 x 127 fits int16
  static __m256i unpack(const Block& b) { return nibbles(b.qs); }
};
struct Q5_0 {
  using Block = BlockQ5_0;
  using X = BlockQ8_0;
  static constexpr bool kSigned = false, kMin = false;
  static constexpr int kOffset = 16, kInt16Steps = 4;  // 4 steps x 2 x 31 x 127 fits int16
  static __m256i unpack(const Block& b) { return _mm256_or_si256(nibbles(b.qs), fifth_bits(b.qh)); }
};
struct Q4_1 {
  using Block = BlockQ4_1;
  using X = BlockQ8_1;
  static constexpr bool kSigned = false, kMin = true;
  static constexpr int kOffset = 0, kInt16Steps = 8;
  static __m256i unpack(const Block& b) { return nibbles(b.qs); }
};
struct Q5_1 {
  using Block = BlockQ5_1;
  using X = BlockQ8_1;
  static constexpr bool kSigned = false, kMin = true;
  static constexpr int kOffset = 0, kInt16Steps = 4;
  static __m256i unpack(const Block& b) { return _mm256_or_si256(nibbles(b.qs), fifth_bits(b.qh)); }
};

// r[s] lane j <- r[j] lane s: 8 x 8 32-bit elements.
inline void transpose8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// The 8 rows of a panel are one contiguous run of memory, read as 8 interleaved short streams
// that the hardware prefetcher barely learns before they end (a row of K = 896 is 8 cache lines).
// So each block step asks for its share of the next panel's bytes: one linear stream, a panel ahead.
template <class Block, int kHint = _MM_HINT_T0>
inline void prefetch_next_panel(const uint8_t* panel_start, int64_t ws, int64_t b) {
  const uint8_t* next = panel_start + kPanel * ws;
  constexpr int64_t kStep = kPanel * static_cast<int64_t>(sizeof(Block));
  for (int64_t off = b * kStep & ~int64_t{63}; off < (b + 1) * kStep; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next + off), static_cast<_mm_hint>(kHint));
}

// vpdpbusd (unsigned bytes times signed bytes, 4 products summed into each int32 lane) where the build has it
// (runlm/native/host.py: vnni_cflags): one instruction for maddubs + madd + add, and no int16 partial sums
// to bound. Integer sums either way: both paths give the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define RUNLM_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#elif defined(__AVXVNNI__)
#define RUNLM_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#else
// acc + (int16 pairs of a times b's, summed in pairs): vpdpwssd where there is VNNI, the same wrapping sum
inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The min term's activation sum d_x * sum(q_x), from the exact integer sum: Q8_1's own field s
// holds it rounded to fp16, which would cost the min term 11 bits (a measurable KL divergence).
template <class W>
inline float x_sum(const typename W::X& xb, int32_t sum) {
  return fp16(xb.d) * static_cast<float>(sum);
}

// Sum of each activation block's 32 int8 values (types with an offset or a min): [rows][nb].
inline int32_t block_sum(const int8_t* qs) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  const __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), v);
  const __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
  __m128i r = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4E));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0xB1));
  return _mm_cvtsi128_si32(r);
}

// h with 16-bit lane r set to v (r a compile-time constant once the loop over rows unrolls).
inline __m128i insert16(__m128i h, uint16_t v, int r) {
  switch (r) {
    case 0: return _mm_insert_epi16(h, v, 0);
    case 1: return _mm_insert_epi16(h, v, 1);
    case 2: return _mm_insert_epi16(h, v, 2);
    case 3: return _mm_insert_epi16(h, v, 3);
    case 4: return _mm_insert_epi16(h, v, 4);
    case 5: return _mm_insert_epi16(h, v, 5);
    case 6: return _mm_insert_epi16(h, v, 6);
    default: return _mm_insert_epi16(h, v, 7);
  }
}

// Lane r <- the sum of v[r]'s 8 lanes (exact: integers).
inline __m256i reduce8(const __m256i v[8]) {
  const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

// One activation row against the 8 weight rows (decode): each row's dot product as 8 integer
// lanes against the whole activation block, then summed across lanes. No transpose: cheaper than
// panel() when no other activation row shares the unpacked weights. Same arithmetic per output.
template <class W>
void panel_row(const uint8_t* const* wrow, int64_t ws, const uint8_t* x, const int32_t* xsum, int64_t nb, float* y, int nvalid) {
  using Block = typename W::Block;
  using X = typename W::X;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_next_panel<Block>(wrow[0], ws, b);
    const X& xb = reinterpret_cast<const X*>(x)[b];
    const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
    __m256i v[kPanel];
    __m128i hd = _mm_setzero_si128(), hm = _mm_setzero_si128();  // registers, not a stack array:
    for (int r = 0; r < kPanel; ++r) {  // 8 small stores then one wide load would stall on forwarding
      const Block& blk = reinterpret_cast<const Block*>(wrow[r])[b];
      const __m256i q = W::unpack(blk);
      hd = insert16(hd, blk.d, r);
      if constexpr (W::kMin) hm = insert16(hm, blk.m, r);
      if constexpr (W::kSigned)
        v[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xq, q)), ones);
      else
        v[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), ones);
    }
    __m256i dot = reduce8(v);
    if constexpr (W::kOffset != 0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(W::kOffset * xsum[b]));
    const __m256 dw = _mm256_cvtph_ps(hd);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(fp16(xb.d))), _mm256_cvtepi32_ps(dot), acc);
    if constexpr (W::kMin) acc = _mm256_fmadd_ps(_mm256_cvtph_ps(hm), _mm256_set1_ps(x_sum<W>(xb, xsum[b])), acc);
  }
  alignas(32) float lanes[kPanel];
  _mm256_store_ps(lanes, acc);
  std::memcpy(y, lanes, sizeof(float) * nvalid);
}

// y[i, 0..nvalid) for activation rows x[0..mc) (stride xs) and the 8 weight rows wrow[0..8).
// xsum: block sums of those activation rows (only read for types with an offset or a min).
template <class W>
void panel(const uint8_t* const* wrow, int64_t ws, const uint8_t* x, int64_t xs, const int32_t* xsum, int64_t nb, int mc,
           float* y, int64_t ldy, int nvalid) {
  using Block = typename W::Block;
  using X = typename W::X;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);  // (unused where VNNI sums)
  __m256 acc[kChunk];
  for (int i = 0; i < mc; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_next_panel<Block>(wrow[0], ws, b);
    __m256i t[kPanel];
    alignas(16) uint16_t hd[kPanel], hm[kPanel];
    for (int r = 0; r < kPanel; ++r) {
      const Block& blk = reinterpret_cast<const Block*>(wrow[r])[b];
      t[r] = W::unpack(blk);
      hd[r] = blk.d;
      if constexpr (W::kMin) hm[r] = blk.m;
    }
    transpose8(t);
    const __m256 dw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(hd)));
    __m256 mw = _mm256_setzero_ps();
    if constexpr (W::kMin) mw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(hm)));
    __m256i a[kPanel];
    if constexpr (W::kSigned)
      for (int s = 0; s < kPanel; ++s) a[s] = _mm256_sign_epi8(t[s], t[s]);
    for (int i = 0; i < mc; ++i) {
      const X& xb = reinterpret_cast<const X*>(x + i * xs)[b];
      __m256i dot = _mm256_setzero_si256();
#ifdef RUNLM_VNNI
      if constexpr (W::kSigned) {  // |w| times x with w's sign, as below
        for (int s = 0; s < kPanel; ++s) dot = dpbusd(dot, a[s], _mm256_sign_epi8(broadcast4(xb.qs + 4 * s), t[s]));
      } else {
        for (int s = 0; s < kPanel; ++s) dot = dpbusd(dot, t[s], broadcast4(xb.qs + 4 * s));
        if constexpr (W::kOffset != 0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(W::kOffset * xsum[i * nb + b]));
      }
#else
      if constexpr (W::kSigned) {
        for (int s = 0; s < kPanel; ++s) {
          const __m256i xv = _mm256_sign_epi8(broadcast4(xb.qs + 4 * s), t[s]);
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(a[s], xv), ones));
        }
      } else {
        for (int g = 0; g < kPanel; g += W::kInt16Steps) {
          __m256i p = _mm256_maddubs_epi16(t[g], broadcast4(xb.qs + 4 * g));
          for (int s = g + 1; s < g + W::kInt16Steps; ++s)
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(t[s], broadcast4(xb.qs + 4 * s)));
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, ones));
        }
        if constexpr (W::kOffset != 0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(W::kOffset * xsum[i * nb + b]));
      }
#endif
      const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(fp16(xb.d)));
      acc[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), acc[i]);
      if constexpr (W::kMin) acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x_sum<W>(xb, xsum[i * nb + b])), acc[i]);
    }
  }
  for (int i = 0; i < mc; ++i) {
    if (nvalid == kPanel) {
      _mm256_storeu_ps(y + i * ldy, acc[i]);
    } else {
      alignas(32) float lanes[kPanel];
      _mm256_store_ps(lanes, acc[i]);
      std::memcpy(y + i * ldy, lanes, sizeof(float) * nvalid);
    }
  }
}

// Output columns [n0, n1) of y = x @ w^T for all m activation rows, n0 a multiple of 8 (a panel
// boundary); rows past n1 read a zero row (their lanes are computed and dropped). Chunks of at most
// kRows activation rows take PanelRow row by row, larger ones Panel (both kernels' driver).
template <int kRows, auto Panel, auto PanelRow>
void drive(const uint8_t* w, int64_t ws, const uint8_t* x, int64_t xs, const int32_t* xsum, int64_t m, int64_t nb,
           float* y, int64_t ldy, int64_t n0, int64_t n1, const uint8_t* zero_row) {
  for (int64_t m0 = 0; m0 < m; m0 += kChunk) {
    const int mc = static_cast<int>(m - m0 < kChunk ? m - m0 : kChunk);
    const int32_t* sums = xsum == nullptr ? nullptr : xsum + m0 * nb;
    for (int64_t n = n0; n < n1; n += kPanel) {
      const uint8_t* wrow[kPanel];
      for (int r = 0; r < kPanel; ++r) wrow[r] = n + r < n1 ? w + (n + r) * ws : zero_row;
      const int nvalid = static_cast<int>(n1 - n < kPanel ? n1 - n : kPanel);
      if (mc <= kRows) {
        for (int i = 0; i < mc; ++i)
          PanelRow(wrow, ws, x + (m0 + i) * xs, sums == nullptr ? nullptr : sums + i * nb, nb, y + (m0 + i) * ldy + n,
                   nvalid);
      } else {
        Panel(wrow, ws, x + m0 * xs, xs, sums, nb, mc, y + m0 * ldy + n, ldy, nvalid);
      }
    }
  }
}

template <class W>
constexpr auto rows = drive<kRowwise, &panel<W>, &panel_row<W>>;

}  // namespace blockgemm
