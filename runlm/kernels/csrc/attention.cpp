// torch wrapper of the paged causal attention (attention_impl.h holds the kernel and its reduction order).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <vector>

#include "attention_impl.h"

namespace {

namespace attn = runlm::attention;

// out[T, H, D] for q[T, H, D] of all scheduled sequences (rows in batch order), or None for
// inputs the kernel does not cover (the caller then uses torch).
c10::optional<at::Tensor> paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                          const at::Tensor& slots_in, const std::vector<int64_t>& query_lens,
                                          const std::vector<int64_t>& context_lens, double scale, int64_t window,
                                          double softcap) {
  const auto covered = [](const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat; };
  if (!covered(q_in) || !covered(k_cache) || !covered(v_cache) || q_in.dim() != 3 || k_cache.dim() != 3 ||
      !k_cache.is_contiguous() || !v_cache.is_contiguous() || slots_in.scalar_type() != at::kLong ||
      !attn::cpu_supported())
    return c10::nullopt;
  const at::Tensor q = q_in.contiguous();
  const at::Tensor slots = slots_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && H % KVH == 0, "runlm attention: head shapes do not match");
  TORCH_CHECK(query_lens.size() == context_lens.size(), "runlm attention: one query and context length per sequence");
  attn::RowPlan plan;
  const std::string bad = attn::plan_rows(query_lens.data(), context_lens.data(),
                                          static_cast<int64_t>(query_lens.size()), T, slots.numel(), plan);
  TORCH_CHECK(bad.empty(), bad);
  at::Tensor out = at::empty({T, H, D}, q.options());
  attn::paged_attention(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                        slots.data_ptr<int64_t>(), plan, T, H, KVH, D, static_cast<float>(scale), window,
                        static_cast<float>(softcap), out.data_ptr<float>());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal fp32 attention over a slot-addressed KV cache; None if not covered");
}
