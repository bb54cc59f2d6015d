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
template <int mr, int nr>
inline void fma_step(__m256 (&acc)[mr][nr], const float* x, const float* w, int64_t K, int64_t k) {
  __m256 xv[mr];
  for (int i = 0; i < mr; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);
  for (int j = 0; j < nr; ++j) {
    const __m256 wv = _mm256_loadu_ps(w + j * K + k);
    for (int i = 0; i < mr; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
  }
}

// y[m0:m0+mr, n0:n0+nr] for one tile, over k in [k0, k1). When the tile covers only part of
// K (k1 < K, or k0 > 0), its 8-lane accumulators are parked in `part` between the calls; the
// chunk borders are multiples of 16, so every FMA step and the order are exactly as unchunked.
template <int mr, int nr>
void tile(const Args& a, int64_t m0, int64_t n0, int64_t k0, int64_t k1, float* part, Prefetch& pf) {
  const int64_t K = a.K;
  const float* x = a.x + m0 * K;
  const float* w = a.w + n0 * K;
  __m256 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j)
      acc[i][j] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(part + (i * nr + j) * 8);

  const int64_t kend = std::min(k1, a.kfull);
  int64_t k = k0;
  for (; k + 16 <= kend; k += 16) {  // unrolled by one cache line; same order as 8 at a time
    pf.step();
    fma_step<mr, nr>(acc, x, w, K, k);
    fma_step<mr, nr>(acc, x, w, K, k + 8);
  }
  if (k < kend) fma_step<mr, nr>(acc, x, w, K, k);
  if (k1 < K) {  // more chunks of K to come
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < nr; ++j) _mm256_storeu_ps(part + (i * nr + j) * 8, acc[i][j]);
    return;
  }
  if (a.kfull < K) {  // K tail: masked loads read zeros past the end, so 0*0 adds nothing
    __m256 xv[mr];
    for (int i = 0; i < mr; ++i) xv[i] = _mm256_maskload_ps(x + i * K + a.kfull, a.tail);
    for (int j = 0; j < nr; ++j) {
      const __m256 wv = _mm256_maskload_ps(w + j * K + a.kfull, a.tail);
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

// kTiles[mr-1][nr-1]: one instantiation per partial tile shape at the M and N edges.
constexpr TileFn kTiles[MR][NR] = {
    {tile<1, 1>, tile<1, 2>, tile<1, 3>, tile<1, 4>},
    {tile<2, 1>, tile<2, 2>, tile<2, 3>, tile<2, 4>},
    {tile<3, 1>, tile<3, 2>, tile<3, 3>, tile<3, 4>},
};

// Rows [b0*NR, b1*NR) of W (clipped to N) against all M rows of x.
void run_blocks(const Args& a, int64_t b0, int64_t b1) {
  const int64_t K = a.K;
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
    Prefetch pf{reinterpret_cast<const char*>(a.w), nullptr, static_cast<int>((NR + tiles - 1) / tiles)};
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NR;
      const int nr = static_cast<int>(std::min<int64_t>(NR, a.N - n0));
      const char* next = reinterpret_cast<const char*>(a.w + std::min(n_end, n0 + NR) * K);
      pf.cur = std::max(pf.cur, next);  // never lag into the block being read anyway
      pf.limit = reinterpret_cast<const char*>(a.w + std::min(n_end, n0 + 2 * NR) * K);
      for (int64_t k0 = 0; k0 < std::max<int64_t>(K, 1); k0 += kc) {  // once when K == 0: writes bias
        const int64_t k1 = std::min(K, k0 + kc);
        for (int64_t m = mc; m < mend; m += MR) {
          const int mr = static_cast<int>(std::min<int64_t>(MR, mend - m));
          float* p = split_k ? part.data() + (m - mc) * NR * 8 : nullptr;
          kTiles[mr - 1][nr - 1](a, m, n0, k0, k1, p, pf);
        }
      }
    }
  }
}

// y[..., N] = x[..., K] @ weight[N, K]^T (+ bias[N]), or None for inputs this kernel does not
// cover (not fp32, not CPU, autograd needed): the caller then uses F.linear. The checks live
// here rather than in Python because they cost ~1 us there, per call.
c10::optional<at::Tensor> linear(const at::Tensor& x, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  const auto covered = [](const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat; };
  if (!covered(x) || !covered(weight) || (has_bias && !covered(*bias)) || weight.dim() != 2 || x.dim() < 1 ||
      !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
    return c10::nullopt;
  const bool wants_grad = x.requires_grad() || weight.requires_grad() || (has_bias && bias->requires_grad());
  if (wants_grad && at::GradMode::is_enabled()) return c10::nullopt;
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(-1) == K, "runlm linear: x has ", x.size(-1), " features, weight expects ", K);
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->numel() == N), "runlm linear: bias must be [N]");

  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  const at::Tensor x2 = x.reshape({M, K}).contiguous();
  const at::Tensor w = weight.contiguous();
  const at::Tensor b = has_bias ? bias->contiguous() : at::Tensor();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end() - 1);
  out_shape.push_back(N);
  at::Tensor y = at::empty(out_shape, x.options());
  if (M == 0 || N == 0) return y;

  Args a{x2.data_ptr<float>(), w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
         y.data_ptr<float>(), M, N, K, K / 8 * 8, first_lanes(K % 8)};
  const int64_t blocks = (N + NR - 1) / NR;
  const int64_t work_per_block = NR * std::max<int64_t>(K, 1) * M;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / work_per_block);
  // Threads take contiguous ranges of W blocks; each output is computed whole by one thread.
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { run_blocks(a, b0, b1); });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ weight^T + bias, batch-invariant AVX2 fp32; None if not covered",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
}
