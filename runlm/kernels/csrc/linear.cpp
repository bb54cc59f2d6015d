// Batch-invariant fp32 linear layer, y = x @ W^T + b, for AVX2 + FMA CPUs.
//
// Reduction order (the contract that makes results batch-invariant):
//   for every output y[m, n], one 8-lane accumulator walks k = 0, 8, 16, ... in order with
//   one FMA per 8-wide block; a K tail of 1..7 elements is one more FMA on zero-padded
//   (masked) loads; the 8 lanes are then summed by the fixed tree in hsum8(); the bias is
//   added last. Nothing here depends on M, on the row's position, on the tile a row lands
//   in, or on the thread count: threads split only the N dimension, never K.
// Every code path below goes through the same tile<>() template, so the GEMV (M = 1),
// small-batch decode and prefill paths produce bitwise-identical rows.
//
// Speed: a tile holds MR rows of x and NR rows of W; its MR*NR accumulators stay in ymm
// registers (3 x 4 = 12 accumulators + 3 x vectors + 1 W vector = all 16 ymm), so each W
// vector load feeds MR FMAs and each x vector load feeds NR FMAs. For decode the kernel
// is bound by streaming W from DRAM; W is read from DRAM once per call (per M-chunk, see
// kChunkBytes) and the next block of W rows is software-prefetched while the current one
// is in use, so the DRAM stream does not stall at block boundaries (that alone is worth
// ~1.5x at M = 1..8 here).
//
// Compiled with -mavx2 -mfma and without -ffast-math (which would let the compiler
// reassociate the sums); the Python side checks the CPU for avx2 + fma before loading.
// Narrow includes instead of <torch/extension.h>: halves the first-use compile (~15 s).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/utils/pybind.h>

#include <immintrin.h>

#include <algorithm>
#include <initializer_list>
#include <utility>
#include <cstdint>
#include <vector>

namespace {

constexpr int MR = 3;  // x rows per tile
constexpr int NR = 4;  // W rows per tile
// x rows are processed in chunks of about this many bytes (of one K-chunk) that stay in L2
// while the thread's W blocks sweep over them; W is read from DRAM once per chunk. (For
// long rows the whole chunk spills to L3; measured, that beats re-reading W more often.)
constexpr int64_t kChunkBytes = 768 * 1024;
// K-chunk for long rows (a multiple of 16): 4 W rows + 3 x rows of it use 28 KB of L1.
constexpr int64_t kKChunk = 1024;
constexpr int64_t kSplitK = 1536;
// Below this many multiply-adds per thread the OpenMP fork/join costs more than it saves.
constexpr int64_t kMinWorkPerThread = 1 << 16;

// The fixed lane-combine order: (a0+a4, a1+a5, a2+a6, a3+a7) -> pairs -> total.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));     // (s0+s2, s1+s3, ., .)
  s = _mm_add_ss(s, _mm_movehdup_ps(s));      // (s0+s2) + (s1+s3)
  return _mm_cvtss_f32(s);
}

// Lane mask selecting the first r (0..8) lanes, for the K tail.
inline __m256i first_lanes(int64_t r) {
  alignas(32) static const int32_t bits[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                               0,  0,  0,  0,  0,  0,  0,  0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + 8 - r));
}

struct Args {
  const float* x;     // [M, K] row-major
  const float* w;     // [N, K] row-major
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N] row-major
  int64_t M, N, K;
  int64_t kfull;      // K rounded down to a multiple of 8
  __m256i tail;       // lanes of the last partial 8-block of K
  // Block-quantized weights instead of w (linear_q8): w[n, k] = q[n, k] * d[n, k/32] + m[n, k/32],
  // computed in registers as multiply-then-add, exactly as the GGUF dequantizer computes it, so
  // the result is bitwise that of the fp32 path on the dequantized weights. K % 32 == 0.
  const int8_t* qw = nullptr;  // [N, K]
  const float* qd = nullptr;   // [N, K/32]
  const float* qm = nullptr;   // [N, K/32]
};

// The W rows of one tile: fp32 rows (Q = false) or block-quantized rows (Q = true).
template <bool Q>
struct WRows {
  const float* w;
  const int8_t* q;
  const float* d;
  const float* m;
  int64_t K, nb;
  WRows(const Args& a, int64_t n0)
      : w(Q ? nullptr : a.w + n0 * a.K), q(Q ? a.qw + n0 * a.K : nullptr), d(Q ? a.qd + n0 * (a.K / 32) : nullptr),
        m(Q ? a.qm + n0 * (a.K / 32) : nullptr), K(a.K), nb(a.K / 32) {}
  inline __m256 load(int j, int64_t k) const {
    if constexpr (Q) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j * K + k));
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      const int64_t blk = j * nb + (k >> 5);
      return _mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(d[blk])), _mm256_set1_ps(m[blk]));
    } else {
      return _mm256_loadu_ps(w + j * K + k);
    }
  }
};

// Software prefetch of W: while a W block is in use, a cursor walks the next block (blocks
// are contiguous in memory); each 16-float step of a tile issues `per_step` line prefetches,
// never past `limit` (the end of the next block).
struct Prefetch {
  const char* cur;
  const char* limit;
  int per_step;
  inline void step() {
    for (int s = 0; s < per_step && cur < limit; ++s, cur += 64) _mm_prefetch(cur, _MM_HINT_T0);
  }
};

// Adds x[i, k:k+8] * w[j, k:k+8] into acc[i][j] for the tile; the one step of the reduction.
template <int mr, int nr, bool Q>
inline void fma_step(__m256 (&acc)[mr][nr], const float* x, const WRows<Q>& w, int64_t K, int64_t k) {
  __m256 xv[mr];
  for (int i = 0; i < mr; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);
  for (int j = 0; j < nr; ++j) {
    const __m256 wv = w.load(j, k);
    for (int i = 0; i < mr; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
  }
}

// y[m0:m0+mr, n0:n0+nr] for one tile, over k in [k0, k1). When the tile covers only part of
// K (k1 < K, or k0 > 0), its 8-lane accumulators are parked in `part` between the calls; the
// chunk borders are multiples of 16, so every FMA step and the order are exactly as unchunked.
template <int mr, int nr, bool Q>
void tile(const Args& a, int64_t m0, int64_t n0, int64_t k0, int64_t k1, float* part, Prefetch& pf) {
  const int64_t K = a.K;
  const float* x = a.x + m0 * K;
  const WRows<Q> w(a, n0);
  __m256 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j)
      acc[i][j] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(part + (i * nr + j) * 8);

  const int64_t kend = std::min(k1, a.kfull);
  int64_t k = k0;
  for (; k + 16 <= kend; k += 16) {  // unrolled by one cache line; same order as 8 at a time
    pf.step();
    fma_step<mr, nr, Q>(acc, x, w, K, k);
    fma_step<mr, nr, Q>(acc, x, w, K, k + 8);
  }
  if (k < kend) fma_step<mr, nr, Q>(acc, x, w, K, k);
  if (k1 < K) {  // more chunks of K to come
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) _mm256_storeu_ps(part + (i * nr + j) * 8, acc[i][j]);
    return;
  }
  if (!Q && a.kfull < K) {  // K tail: masked loads read zeros past the end, so 0*0 adds nothing
    __m256 xv[mr];
    for (int i = 0; i < mr; ++i) xv[i] = _mm256_maskload_ps(x + i * K + a.kfull, a.tail);
    for (int j = 0; j < nr; ++j) {
      const __m256 wv = _mm256_maskload_ps(w.w + j * K + a.kfull, a.tail);
      for (int i = 0; i < mr; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < mr; ++i) {
    float* y = a.y + (m0 + i) * a.N + n0;
    for (int j = 0; j < nr; ++j) {
      const float s = hsum8(acc[i][j]);
      y[j] = a.bias ? s + a.bias[n0 + j] : s;
    }
  }
}

using TileFn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t, float*, Prefetch&);

// kTiles<Q>[mr-1][nr-1]: one instantiation per partial tile shape at the M and N edges.
template <bool Q>
constexpr TileFn kTiles[MR][NR] = {
    {tile<1, 1, Q>, tile<1, 2, Q>, tile<1, 3, Q>, tile<1, 4, Q>},
    {tile<2, 1, Q>, tile<2, 2, Q>, tile<2, 3, Q>, tile<2, 4, Q>},
    {tile<3, 1, Q>, tile<3, 2, Q>, tile<3, 3, Q>, tile<3, 4, Q>},
};

// Rows [b0*NR, b1*NR) of W (clipped to N) against all M rows of x.
template <bool Q>
void run_blocks(const Args& a, int64_t b0, int64_t b1) {
  const int64_t K = a.K;
  // W as bytes, for the prefetcher: fp32 rows of 4K bytes or int8 rows of K bytes
  const char* wbytes = Q ? reinterpret_cast<const char*>(a.qw) : reinterpret_cast<const char*>(a.w);
  const int64_t row_bytes = Q ? K : 4 * K;
  // Long rows are cut into K-chunks when several tiles reuse a W block, so that the block's
  // chunk (and the tile's x rows) stay in L1 instead of being re-read from L2 by every tile.
  const bool split_k = a.M > MR && K >= kSplitK;
  const int64_t kc = split_k ? kKChunk : std::max<int64_t>(K, 1);
  const int64_t chunk = std::max<int64_t>(MR, kChunkBytes / (std::min(K, kc) * 4 + 4) / MR * MR);
  std::vector<float> part(split_k ? chunk * NR * 8 : 0);  // 8 lanes per (row, W row)
  const int64_t n_end = std::min(a.N, b1 * NR);
  for (int64_t mc = 0; mc < a.M; mc += chunk) {
    const int64_t mend = std::min(a.M, mc + chunk);
    const int64_t tiles = (mend - mc + MR - 1) / MR;
    // Spread the prefetch of the next block over all tiles of the current one: at least NR
    // lines per 16-float step in total, i.e. at least one block per block.
    Prefetch pf{wbytes, nullptr, static_cast<int>((NR + tiles - 1) / tiles)};
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NR;
      const int nr = static_cast<int>(std::min<int64_t>(NR, a.N - n0));
      const char* next = wbytes + std::min(n_end, n0 + NR) * row_bytes;
      pf.cur = std::max(pf.cur, next);  // never lag into the block being read anyway
      pf.limit = wbytes + std::min(n_end, n0 + 2 * NR) * row_bytes;
      for (int64_t k0 = 0; k0 < std::max<int64_t>(K, 1); k0 += kc) {  // once when K == 0: writes bias
        const int64_t k1 = std::min(K, k0 + kc);
        for (int64_t m = mc; m < mend; m += MR) {
          const int mr = static_cast<int>(std::min<int64_t>(MR, mend - m));
          float* p = split_k ? part.data() + (m - mc) * NR * 8 : nullptr;
          kTiles<Q>[mr - 1][nr - 1](a, m, n0, k0, k1, p, pf);
        }
      }
    }
  }
}

// Splits the W blocks over threads; each output is computed whole by one thread.
template <bool Q>
void launch(const Args& a) {
  const int64_t blocks = (a.N + NR - 1) / NR;
  const int64_t work_per_block = NR * std::max<int64_t>(a.K, 1) * a.M;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / work_per_block);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { run_blocks<Q>(a, b0, b1); });
}

inline bool covered(const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat; }

inline bool cpu_ok() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// x as [M, K] (a contiguous view or copy) and the output tensor shaped [..., N].
std::pair<at::Tensor, at::Tensor> rows_and_output(const at::Tensor& x, int64_t N, int64_t K) {
  TORCH_CHECK(x.size(-1) == K, "runlm linear: x has ", x.size(-1), " features, weight expects ", K);
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end() - 1);
  out_shape.push_back(N);
  return {x.reshape({M, K}).contiguous(), at::empty(out_shape, x.options())};
}

bool wants_graph(std::initializer_list<const at::Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : ts)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

// y[..., N] = x[..., K] @ weight[N, K]^T (+ bias[N]), or None for inputs this kernel does not
// cover (not fp32, not CPU, autograd needed): the caller then uses F.linear. The checks live
// here rather than in Python because they cost ~1 us there, per call.
c10::optional<at::Tensor> linear(const at::Tensor& x, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& bias) {
  const at::Tensor b = bias.has_value() && bias->defined() ? *bias : at::Tensor();
  if (!covered(x) || !covered(weight) || (b.defined() && !covered(b)) || weight.dim() != 2 || x.dim() < 1 ||
      !cpu_ok() || wants_graph({&x, &weight, &b}))
    return c10::nullopt;
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.numel() == N), "runlm linear: bias must be [N]");
  auto [x2, y] = rows_and_output(x, N, K);
  if (x2.size(0) == 0 || N == 0) return y;
  const at::Tensor w = weight.contiguous();
  const at::Tensor bc = b.defined() ? b.contiguous() : b;
  Args a{x2.data_ptr<float>(), w.data_ptr<float>(), bc.defined() ? bc.data_ptr<float>() : nullptr,
         y.data_ptr<float>(), x2.size(0), N, K, K / 8 * 8, first_lanes(K % 8)};
  launch<false>(a);
  return y;
}

// The same product with W block-quantized: qweight int8 [N, K], scales and offsets fp32
// [N, K/32] (w = q * scale + offset per block of 32 along K). None where not covered.
c10::optional<at::Tensor> linear_q8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                    const at::Tensor& offsets, const c10::optional<at::Tensor>& bias) {
  const at::Tensor b = bias.has_value() && bias->defined() ? *bias : at::Tensor();
  if (!covered(x) || !covered(scales) || !covered(offsets) || (b.defined() && !covered(b)) ||
      qweight.scalar_type() != at::kChar || !qweight.device().is_cpu() || qweight.dim() != 2 || x.dim() < 1 ||
      !cpu_ok() || wants_graph({&x, &b}))
    return c10::nullopt;
  const int64_t N = qweight.size(0), K = qweight.size(1);
  TORCH_CHECK(K % 32 == 0, "runlm linear_q8: K must be a multiple of 32, got ", K);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / 32 &&
                  offsets.sizes() == scales.sizes(),
              "runlm linear_q8: scales and offsets must be [N, K/32]");
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.numel() == N), "runlm linear: bias must be [N]");
  auto [x2, y] = rows_and_output(x, N, K);
  if (x2.size(0) == 0 || N == 0) return y;
  const at::Tensor q = qweight.contiguous(), d = scales.contiguous(), m = offsets.contiguous();
  const at::Tensor bc = b.defined() ? b.contiguous() : b;
  Args a{x2.data_ptr<float>(), nullptr, bc.defined() ? bc.data_ptr<float>() : nullptr, y.data_ptr<float>(),
         x2.size(0), N, K, K, first_lanes(0), q.data_ptr<int8_t>(), d.data_ptr<float>(), m.data_ptr<float>()};
  launch<true>(a);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ weight^T + bias, batch-invariant AVX2 fp32; None if not covered",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
  m.def("linear_q8", &linear_q8, "linear with int8 weights and per-32 scales/offsets; None if not covered",
        pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("scales"), pybind11::arg("offsets"),
        pybind11::arg("bias") = pybind11::none());
}
