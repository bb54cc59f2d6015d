// Linear layers and embedding lookups on GGUF weights as stored, through ggml's CPU type traits, on
// raw pointers: ggml_linear.cpp wraps them for torch, native_abi.cpp for runlm's torch-free runner.
//
// A weight is one or more "segments": a raw [N_i, row_bytes] uint8 view of the mapped file in
// its own ggml block type (Q4_K, Q6_K, Q8_0, F16, IQ4_XS, ...). Outputs of the segments are
// concatenated, so q/k/v or gate/up stay separate tensors in the file (no copy) yet run as one
// call. Each row of x is quantized once per activation type the segments ask for (Q8_0, Q8_1,
// Q8_K, F16, ...: the type's `vec_dot_type`), then every output is one `vec_dot` of a weight
// row with a quantized x row: llama.cpp's own numerics and SIMD kernels (the prebuilt
// libggml-cpu picks AVX2 / AVX-512 / VNNI code at load time).
//
// The 32-value block types (Q8_0, Q4_0, Q5_0, Q4_1, Q5_1) and the K-quants Q4_K, Q5_K, Q6_K go
// through our own kernels instead (block_gemm.h, kquant_gemm.h: 8 weight rows unpacked once per
// block and multiplied into every activation row, the 8 results in 8 SIMD lanes: no horizontal
// sums; prefill is compute-bound). bench/quant_gemm_bench.py compares them with vec_dot. BF16 and
// F16 (safetensors checkpoints as stored) go through half_gemm.h: tiles of weight and activation
// rows sharing each widened step.
//
// Batch invariance: y[m, n] depends only on x row m and weight row n (one pair's dot product),
// never on M, on the tile a row lands in, or on the thread count; threads split N only.
#pragma once

#include <ggml-cpu.h>
#include <ggml.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "block_gemm.h"
#include "half_gemm.h"
#include "kquant_gemm.h"
#include "kquant_packed.h"
#include "parallel.h"

namespace runlm::ggml_linear {

// Weight rows a thread keeps hot in L1/L2 while every x row passes over them (prefill).
constexpr int64_t kRowTile = 16;
// Below this many weight bytes a call stays on one thread: fork/join would cost more.
constexpr int64_t kMinBytesPerThread = 32 * 1024;

inline const ggml_type_traits_cpu* cpu_traits(int64_t type) {
  return ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
}

inline bool supported(int64_t type) {
  if (type < 0 || type >= GGML_TYPE_COUNT) return false;
  const ggml_type t = static_cast<ggml_type>(type);
  const auto* tr = cpu_traits(t);
  if (tr == nullptr || tr->vec_dot == nullptr || ggml_get_type_traits(t)->to_float == nullptr) return false;
  if (ggml_blck_size(t) <= 0 || ggml_get_type_traits(t)->blck_size == 0) return false;
  const ggml_type vt = tr->vec_dot_type;
  return vt == GGML_TYPE_F32 || cpu_traits(vt)->from_float != nullptr;
}

inline int64_t row_bytes(int64_t type, int64_t k) {
  return static_cast<int64_t>(ggml_row_size(static_cast<ggml_type>(type), k));
}

inline int64_t block_size(int64_t type) { return static_cast<int64_t>(ggml_blck_size(static_cast<ggml_type>(type))); }

// Whether rows of `bytes` bytes hold K values of `type`; an error message, or "" when they do.
inline std::string check_segment(int64_t type, int64_t k, int64_t bytes) {
  if (!supported(type)) return "ggml type " + std::to_string(type) + " has no CPU dot product";
  const char* name = ggml_type_name(static_cast<ggml_type>(type));
  if (k % block_size(type) != 0)
    return "K=" + std::to_string(k) + " is not a whole number of " + name + " blocks";
  if (bytes != row_bytes(type, k))
    return "row of " + std::to_string(bytes) + " bytes, but " + name + " needs " + std::to_string(row_bytes(type, k)) +
           " for K=" + std::to_string(k);
  return "";
}

// One segment: rows [N_i, row_bytes] of ggml type `type`, row n at data + n * row_bytes.
struct Segment {
  const uint8_t* data;
  int64_t rows, row_bytes, type;
};

// Our kernel for a weight type, if it has one: rows [n0, n1) of one segment; and whether it reads
// the activation blocks' sums (types stored with an offset or a min: its own traits say).
using BlockRows = void (*)(const uint8_t*, int64_t, const uint8_t*, int64_t, const int32_t*, int64_t, int64_t,
                           float*, int64_t, int64_t, int64_t, const uint8_t*);
struct OurKernel {
  BlockRows rows = nullptr;
  bool block_sums = false;
};

template <class W>
OurKernel block_type() {
  return {blockgemm::rows<W>, W::kOffset != 0 || W::kMin};
}

template <class W>
OurKernel kquant_type() {
  return {kquant::rows<W>, false};  // Q8_K rows carry their own group sums
}

inline OurKernel our_kernel(int64_t type) {
  switch (type) {
    case GGML_TYPE_Q8_0: return block_type<blockgemm::Q8_0>();
    case GGML_TYPE_Q4_0: return block_type<blockgemm::Q4_0>();
    case GGML_TYPE_Q5_0: return block_type<blockgemm::Q5_0>();
    case GGML_TYPE_Q4_1: return block_type<blockgemm::Q4_1>();
    case GGML_TYPE_Q5_1: return block_type<blockgemm::Q5_1>();
    case GGML_TYPE_Q4_K: return kquant_type<kquant::Q4_K>();
    case GGML_TYPE_Q5_K: return kquant_type<kquant::Q5_K>();
    case GGML_TYPE_Q6_K: return kquant_type<kquant::Q6_K>();
    case GGML_TYPE_BF16: return {halfgemm::rows<halfgemm::BF16>, false};  // (half_gemm.h)
    case GGML_TYPE_F16: return {halfgemm::rows<halfgemm::F16>, false};
    default: return {};
  }
}

// What a weight's segments need, worked out once: each segment's activation type and kernel, and
// the work items threads share (panels of 8 rows of one segment for our kernels, kRowTile rows for
// vec_dot's).
struct Plan {
  struct Item { int seg; int64_t lo, hi; };
  std::vector<Segment> segs;
  std::vector<int64_t> col0;       // first output column of each segment; back() = N
  std::vector<ggml_type> xtypes;   // distinct activation types, in order of first use
  std::vector<int> seg_x;          // segment -> index into xtypes
  std::vector<OurKernel> ours;
  std::vector<bool> x_sums;        // per activation type: some segment's kernel reads its block sums
  std::vector<std::vector<uint8_t>> zero_rows;  // per segment with our kernel: the row read past its end
  // per segment: its rows repacked for its kernel (kquant_packed.h), or null (left uninitialised until packed: no
  // zeroing pass over what the packing writes whole)
  std::vector<std::shared_ptr<const uint8_t[]>> packed;  // (read-only once packed: copies of a plan share it)
  std::vector<Item> items;
  int64_t k = 0, wbytes = 0;
};

// Segment s's rows repacked into panels of Pack (kquant_packed.h), and its kernel the packed one.
template <class Pack>
inline void pack_segment(Plan& p, size_t s) {
  const Segment& w = p.segs[s];
  const int64_t nsb = p.k / kquant::QK_K, panels = kquant::packed::panels(w.rows);
  std::shared_ptr<uint8_t[]> buf(new uint8_t[static_cast<size_t>(panels * nsb) * sizeof(Pack)]);
  auto* out = reinterpret_cast<Pack*>(buf.get());
  parallel_for(0, panels, 64,
               [&](int64_t b, int64_t e) { kquant::packed::pack(w.data, w.row_bytes, w.rows, nsb, b, e, out); });
  p.packed[s] = std::move(buf);
  p.ours[s] = {kquant::packed::rows<Pack>, false};
}

// The plan for segments of K columns; an error message, or "" and the plan. vec_dot_only: none of
// our kernels (the benchmark's comparison). pack: Q4_K and Q6_K segments repacked for their kernels (a copy the
// plan owns, made once: for a caller that keeps the plan, as the native runner does; the same bits either way).
inline std::string make_plan(std::vector<Segment> segs, int64_t k, bool vec_dot_only, Plan& p, bool pack = false) {
  if (segs.empty()) return "one type per weight segment";
  p = Plan{};
  p.k = k;
  p.col0.assign(segs.size() + 1, 0);
  for (size_t s = 0; s < segs.size(); ++s) {
    const std::string bad = check_segment(segs[s].type, k, segs[s].row_bytes);
    if (!bad.empty()) return bad;
    p.col0[s + 1] = p.col0[s] + segs[s].rows;
    p.wbytes += segs[s].rows * segs[s].row_bytes;
  }
  p.seg_x.resize(segs.size());
  p.ours.resize(segs.size());
  p.zero_rows.resize(segs.size());
  for (size_t s = 0; s < segs.size(); ++s) {
    const ggml_type vt = cpu_traits(segs[s].type)->vec_dot_type;
    auto it = std::find(p.xtypes.begin(), p.xtypes.end(), vt);
    if (it == p.xtypes.end()) {
      p.xtypes.push_back(vt);
      p.x_sums.push_back(false);
      it = p.xtypes.end() - 1;
    }
    const int xi = static_cast<int>(it - p.xtypes.begin());
    p.seg_x[s] = xi;
    if (!vec_dot_only) p.ours[s] = our_kernel(segs[s].type);
    if (p.ours[s].block_sums) p.x_sums[xi] = true;
    const int64_t step = p.ours[s].rows != nullptr ? blockgemm::kPanel : kRowTile;
    if (p.ours[s].rows != nullptr) p.zero_rows[s].assign(static_cast<size_t>(segs[s].row_bytes), 0);
    for (int64_t r = 0; r < segs[s].rows; r += step)
      p.items.push_back({static_cast<int>(s), r, std::min(segs[s].rows, r + step)});
  }
  p.segs = std::move(segs);
  p.packed.resize(p.segs.size());
  if (pack && !vec_dot_only)
    for (size_t s = 0; s < p.segs.size(); ++s)
      if (p.segs[s].type == GGML_TYPE_Q4_K)
        pack_segment<kquant::packed::Q4_Kx8>(p, s);
      else if (p.segs[s].type == GGML_TYPE_Q6_K)
        pack_segment<kquant::packed::Q6_Kx8>(p, s);
  return "";
}

// x rows quantized to one activation type: row m at data + m * stride.
struct QuantizedRows {
  ggml_type type;
  std::vector<uint8_t> buf;
  const uint8_t* data = nullptr;
  int64_t stride = 0;
  std::vector<int32_t> block_sums;  // Q8_0/Q8_1 rows: each block's sum of values, [m][k / 32]
  bool sums = false;                // block_sums hold this call's rows
};

// Quantized activations, kept between calls by a caller that makes many (the native decoder).
using Scratch = std::vector<QuantizedRows>;

template <class X>
void block_sums_of(QuantizedRows& q, int64_t m, int64_t nb) {
  for (int64_t i = 0; i < m; ++i) {
    const auto* blocks = reinterpret_cast<const X*>(q.data + i * q.stride);
    for (int64_t b = 0; b < nb; ++b) q.block_sums[i * nb + b] = blockgemm::block_sum(blocks[b].qs);
  }
}

// Each x block's sum of values (Q8_0 or Q8_1 rows).
inline void compute_block_sums(QuantizedRows& q, int64_t m, int64_t k) {
  const int64_t nb = k / blockgemm::QK;
  q.block_sums.resize(static_cast<size_t>(m * nb));
  if (q.type == GGML_TYPE_Q8_1)
    block_sums_of<blockgemm::BlockQ8_1>(q, m, nb);
  else
    block_sums_of<blockgemm::BlockQ8_0>(q, m, nb);
  q.sums = true;
}

inline void quantize_rows(const float* x, int64_t m, int64_t k, ggml_type type, QuantizedRows& out) {
  out.type = type;
  out.sums = false;
  if (type == GGML_TYPE_F32) {  // F32 weights take x as it is
    out.data = reinterpret_cast<const uint8_t*>(x);
    out.stride = k * static_cast<int64_t>(sizeof(float));
    return;
  }
  out.stride = row_bytes(type, k);
  if (out.buf.size() < static_cast<size_t>(out.stride * m)) out.buf.resize(static_cast<size_t>(out.stride * m));
  const auto from_float = cpu_traits(type)->from_float;
  uint8_t* dst = out.buf.data();
  const int64_t stride = out.stride;
  parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) from_float(x + i * k, dst + i * stride, k);
  });
  out.data = out.buf.data();
}

// y[:, col0 : col0 + N_seg] for one segment, rows [n0, n1) of it.
inline void segment_rows(const uint8_t* w, int64_t wstride, ggml_vec_dot_t dot, const QuantizedRows& xq, int64_t m,
                         int64_t k, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t t0 = n0; t0 < n1; t0 += kRowTile) {
    const int64_t t1 = std::min(n1, t0 + kRowTile);
    for (int64_t i = 0; i < m; ++i) {
      const uint8_t* xr = xq.data + i * xq.stride;
      float* yr = y + i * ldy;
      for (int64_t n = t0; n < t1; ++n) dot(static_cast<int>(k), yr + n, 0, w + n * wstride, 0, xr, 0, 1);
    }
  }
}

// y [m, N] = x [m, K] @ concat(segments)^T (+ bias [N], when not null).
inline void linear(const float* x, int64_t m, const Plan& p, const float* bias, float* y, Scratch& qx) {
  if (m == 0) return;
  const int64_t k = p.k, n = p.col0.back();
  // one quantized copy of x per activation type the segments need (usually one, Q8_K + Q8_0 at most)
  if (qx.size() < p.xtypes.size()) qx.resize(p.xtypes.size());
  for (size_t i = 0; i < p.xtypes.size(); ++i) {
    quantize_rows(x, m, k, p.xtypes[i], qx[i]);
    if (p.x_sums[i]) compute_block_sums(qx[i], m, k);
  }
  const int64_t bytes_per_item = std::max<int64_t>(1, p.wbytes / static_cast<int64_t>(p.items.size()));
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / (bytes_per_item * m));
  parallel_pieces(0, static_cast<int64_t>(p.items.size()), grain, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const Plan::Item& item = p.items[it];
      const int s = item.seg;
      // neighbouring items of one segment run as one call: the kernel then streams their rows in order
      int64_t hi = item.hi;
      while (it + 1 < e && p.items[it + 1].seg == s) hi = p.items[++it].hi;
      const Segment& w = p.segs[s];
      const QuantizedRows& xq = qx[p.seg_x[s]];
      if (const BlockRows kernel = p.ours[s].rows)
        kernel(p.packed[s] ? p.packed[s].get() : w.data, w.row_bytes, xq.data, xq.stride,
               xq.sums ? xq.block_sums.data() : nullptr, m,
               k / block_size(w.type), y + p.col0[s], n, item.lo, hi, p.zero_rows[s].data());
      else
        segment_rows(w.data, w.row_bytes, cpu_traits(w.type)->vec_dot, xq, m, k, y + p.col0[s], n, item.lo, hi);
    }
  });
  if (bias != nullptr)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) y[i * n + j] += bias[j];
}

// Rows `ids` (all checked: 0 <= id < V) of a [V, row_bytes] table, dequantized to out [T, K].
inline void embedding(const int64_t* ids, int64_t t, const uint8_t* table, int64_t stride, int64_t type, int64_t k,
                      float* out) {
  const auto to_float = ggml_get_type_traits(static_cast<ggml_type>(type))->to_float;
  for (int64_t i = 0; i < t; ++i) to_float(table + ids[i] * stride, out + i * k, k);
}

// The first id outside [0, V), as an error message, or "".
inline std::string check_ids(const int64_t* ids, int64_t t, int64_t v) {
  for (int64_t i = 0; i < t; ++i)
    if (ids[i] < 0 || ids[i] >= v)
      return "token id " + std::to_string(ids[i]) + " is outside the vocabulary of " + std::to_string(v);
  return "";
}

// The whole [N, row_bytes] table as fp32 [N, K] (exact mode, and tests).
inline void dequantize(const uint8_t* table, int64_t rows, int64_t stride, int64_t type, int64_t k, float* out) {
  const auto to_float = ggml_get_type_traits(static_cast<ggml_type>(type))->to_float;
  parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) to_float(table + i * stride, out + i * k, k);
  });
}

// The SIMD features ggml's CPU backend uses, space-separated.
inline std::string cpu_features() {
  std::string s;
  const std::pair<const char*, int> flags[] = {
      {"AVX", ggml_cpu_has_avx()},           {"AVX2", ggml_cpu_has_avx2()},
      {"FMA", ggml_cpu_has_fma()},           {"F16C", ggml_cpu_has_f16c()},
      {"AVX_VNNI", ggml_cpu_has_avx_vnni()}, {"AVX512", ggml_cpu_has_avx512()},
      {"AVX512_VNNI", ggml_cpu_has_avx512_vnni()}, {"AVX512_BF16", ggml_cpu_has_avx512_bf16()},
      {"NEON", ggml_cpu_has_neon()},         {"DOTPROD", ggml_cpu_has_dotprod()}};
  for (const auto& [name, on] : flags)
    if (on) s += (s.empty() ? "" : " ") + std::string(name);
  return s;
}

}  // namespace runlm::ggml_linear
