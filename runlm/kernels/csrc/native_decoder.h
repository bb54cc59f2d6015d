// A whole decoder step in one native call, for runlm's torch-free runner: the token embedding, then
// per layer exactly LlamaModel._forward_fused's sequence of ops (the same impl functions, in the same
// order, on the same values, so the hidden states are the per-op path's bit for bit), then the final
// norm. Rows given as embeddings (a vision tower's, for an image's tokens) replace their tokens' after the
// embedding scale, as the torch model's ForwardContext.mm_embeds does. Scratch buffers live here and are reused across steps (grown when a step has more rows).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attention_impl.h"
#include "fused_ops_impl.h"
#include "ggml_linear_impl.h"
#include "lora_impl.h"
#include "kv_q8_impl.h"
#include "moe_impl.h"

namespace runlm::decoder {

namespace gl = runlm::ggml_linear;

// A linear layer's weights: its segments' plan and an optional fp32 bias [N].
struct Weights {
  gl::Plan plan;
  const float* bias = nullptr;

  int64_t in() const { return plan.k; }
  int64_t out() const { return plan.col0.back(); }
  void apply(const float* x, int64_t m, float* y, gl::Scratch& scratch) const { gl::linear(x, m, plan, bias, y, scratch); }
};

// A layer's settings beyond the Llama layer's (Phi-3, OLMo2/OLMoE, Gemma 2/3): partial rotary, q/k norms
// over the whole projection, and the KV group holding its K/V (Gemma's sliding-window layers have a cache
// of their own: runlm/engine/core/kv_groups.py).
struct FamilyOpts {
  int64_t rotary = 0;          // RoPE's features per head (the cos/sin tables' width); 0: head_dim
  bool qk_norm_whole = false;  // q_norm [H D], k_norm [KVH D]
  int64_t group = 0;           // 0: the step's slot_mapping / flat_slots; g > 0: GroupSlots' group g
};

// The slots of the KV groups after the first, for one step: group g (1..n) writes its new tokens' K/V to
// slot_maps[(g - 1) T ...] and reads its context from flat[(g - 1) n_flat ...] (same lengths as group 0's).
struct GroupSlots {
  int64_t n = 0;
  const int64_t* slot_maps = nullptr;
  const int64_t* flat = nullptr;
};

// One layer's weights and settings (pointers into arrays the caller keeps alive).
struct Layer {
  const Weights *qkv = nullptr, *o = nullptr, *gate_up = nullptr, *down = nullptr;
  const float *input_norm = nullptr, *post_norm = nullptr;  // post_norm: the MLP input's norm
  const float *q_norm = nullptr, *k_norm = nullptr;         // [D] or null
  const float *attn_out_norm = nullptr, *mlp_out_norm = nullptr;  // Gemma's sandwich norms, or null
  const float *cos = nullptr, *sin = nullptr;               // [rope_rows, D]
  int64_t rope_rows = 0;
  float scale = 1.0f;
  int64_t window = 0;   // 0: none
  float softcap = 0.0f; // 0: none
  const float* sinks = nullptr;  // [H] each head's attention sink logit (gpt-oss), or null
  bool gelu = false;    // the MLP's activation: gelu_tanh, else silu
  float *k_cache = nullptr, *v_cache = nullptr;  // [cache_slots, KVH, D]
  kv_q8::Cache q8;                                // set instead of k_cache / v_cache: a q8_0 or fp16 cache
  int64_t cache_slots = 0;
  const moe::Experts* moe = nullptr;  // a mixture of experts instead of gate_up / down (moe_impl.h)
  FamilyOpts fam;
};

struct Decoder {
  int64_t hidden, heads, kv_heads, head_dim;
  float eps;
  bool interleaved;
  const uint8_t* embed = nullptr;
  int64_t vocab, embed_row_bytes, embed_type;
  float embed_scale = 1.0f;  // Gemma multiplies the embedding by sqrt(hidden)
  const float* final_norm = nullptr;
  std::vector<Layer> layers;
  lora::Adapters lora;  // LoRA adapters, and the present step's rows per adapter (csrc/lora_impl.h)

  // scratch, grown on demand
  int64_t rows = 0;
  std::vector<float> residual, h, qkv, q, attn, o, gate_up, act, m;
  gl::Scratch quantized;
  kv_q8::Staging kv8;
  moe::Scratch moe_scratch;
  attention::RowPlan plan;

  void grow(int64_t t) {
    if (t <= rows) return;
    int64_t widest_mlp = 0;
    for (const Layer& l : layers)
      if (l.gate_up) widest_mlp = std::max(widest_mlp, l.gate_up->out());
    const auto size = [t](std::vector<float>& v, int64_t width) { v.resize(static_cast<size_t>(t * width)); };
    const int64_t qd = heads * head_dim;
    size(residual, hidden), size(h, hidden), size(o, hidden), size(m, hidden);
    size(qkv, (heads + 2 * kv_heads) * head_dim), size(q, qd), size(attn, qd);
    size(gate_up, widest_mlp), size(act, widest_mlp / 2);
    rows = t;
  }

  // Every layer's shapes against the decoder's; an error message, or "".
  std::string check() const {
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      const std::string at = "layer " + std::to_string(i) + ": ";
      if (!l.qkv || !l.o || (!l.moe && (!l.gate_up || !l.down)) || !l.input_norm || !l.post_norm || !l.cos || !l.sin)
        return at + "not set";
      if (l.moe && l.moe->hidden != hidden) return at + "the experts' hidden size is not the decoder's";
      const int64_t qd = heads * head_dim;
      if (l.qkv->in() != hidden || l.qkv->out() != (heads + 2 * kv_heads) * head_dim)
        return at + "qkv must be [(H + 2 KVH) * D, hidden]";
      if (l.o->in() != qd || l.o->out() != hidden) return at + "o must be [hidden, H * D]";
      if (l.moe) continue;
      const int64_t two_i = l.gate_up->out();
      if (l.gate_up->in() != hidden || two_i % 2 != 0) return at + "gate_up must be [2 I, hidden]";
      if (l.down->in() != two_i / 2 || l.down->out() != hidden) return at + "down must be [hidden, I]";
    }
    return "";
  }

  // Positions within every layer's RoPE table, and each KV group's slots within the smallest cache of its
  // layers; an error message, or "".
  std::string check_slots(const int64_t* positions, const int64_t* slot_mapping, int64_t t, const int64_t* flat_slots,
                          int64_t n_flat, const GroupSlots& groups) const {
    int64_t rope_rows = layers[0].rope_rows;
    for (const Layer& l : layers) {
      rope_rows = std::min(rope_rows, l.rope_rows);
      if (l.fam.group < 0 || l.fam.group > groups.n || (l.fam.group > 0 && (!groups.slot_maps || !groups.flat)))
        return "no slots given for KV group " + std::to_string(l.fam.group);
    }
    for (int64_t g = 0; g <= groups.n; ++g) {
      int64_t cache_slots = -1;  // the smallest of the group's layers
      for (const Layer& l : layers)
        if (l.fam.group == g) cache_slots = cache_slots < 0 ? l.cache_slots : std::min(cache_slots, l.cache_slots);
      if (cache_slots < 0) continue;
      const int64_t* slots = g == 0 ? slot_mapping : groups.slot_maps + (g - 1) * t;
      const int64_t* context = g == 0 ? flat_slots : groups.flat + (g - 1) * n_flat;
      std::string bad = fused::check_qkv_rows({t, heads, kv_heads, head_dim, rope_rows, cache_slots, interleaved},
                                              positions, slots);
      if (!bad.empty()) return bad;
      for (int64_t i = 0; i < n_flat; ++i)
        if (context[i] < 0 || context[i] >= cache_slots)
          return "context slot " + std::to_string(context[i]) + " is outside the cache";
    }
    return "";
  }

  // out [T, hidden]: the final-normed hidden states of tokens ids at positions, their K/V written to
  // slot_mapping; query_lens/context_lens per sequence, flat_slots every sequence's context slots.
  // n_embeds rows embed_rows (each in [0, T)) take embed_values [n_embeds, hidden] instead of their token's
  // (scaled) embedding: an image's rows from a vision tower. None (0, null) for a text-only step.
  // groups: the slots of the KV groups after the first (none where one cache holds every layer's K/V).
  std::string forward(const int64_t* ids, const int64_t* positions, const int64_t* slot_mapping, int64_t t,
                      const int64_t* query_lens, const int64_t* context_lens, int64_t batch, const int64_t* flat_slots,
                      int64_t n_flat, float* out, const int64_t* embed_rows = nullptr, const float* embed_values = nullptr,
                      int64_t n_embeds = 0, const GroupSlots& groups = GroupSlots{}) {
    if (layers.empty()) return "a decoder needs at least one layer";
    for (const Layer& l : layers)
      if ((!l.k_cache || !l.v_cache) && (!l.q8.k || !l.q8.v)) return "no KV cache set";
    std::string bad = gl::check_ids(ids, t, vocab);
    if (bad.empty()) bad = lora.check_step(t);
    if (bad.empty()) bad = attention::plan_rows(query_lens, context_lens, batch, t, n_flat, plan);
    if (!bad.empty()) return bad;
    bad = check_slots(positions, slot_mapping, t, flat_slots, n_flat, groups);
    if (!bad.empty()) return bad;
    if (n_embeds < 0 || (n_embeds > 0 && (!embed_rows || !embed_values))) return "bad embedding rows";
    for (int64_t i = 0; i < n_embeds; ++i)
      if (embed_rows[i] < 0 || embed_rows[i] >= t)
        return "embedding row " + std::to_string(embed_rows[i]) + " is outside the step's " + std::to_string(t) + " rows";
    if (t == 0) return "";
    grow(t);
    float *res = residual.data(), *hp = h.data();
    gl::embedding(ids, t, embed, embed_row_bytes, embed_type, hidden, res);
    if (embed_scale != 1.0f)
      for (int64_t i = 0, n = t * hidden; i < n; ++i) res[i] = res[i] * embed_scale;
    for (int64_t i = 0; i < n_embeds; ++i)  // written over the scaled embedding, as the torch model does
      std::memcpy(res + embed_rows[i] * hidden, embed_values + i * hidden, sizeof(float) * static_cast<size_t>(hidden));
    fused::rms_norm(res, layers[0].input_norm, hp, t, hidden, eps);
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      const fused::QkvShape shape{t, heads, kv_heads, head_dim, l.rope_rows, l.cache_slots, interleaved,
                                  l.fam.rotary, l.fam.qk_norm_whole};
      const int64_t g = l.fam.group;
      const int64_t* slots = g == 0 ? slot_mapping : groups.slot_maps + (g - 1) * t;
      const int64_t* context = g == 0 ? flat_slots : groups.flat + (g - 1) * n_flat;
      l.qkv->apply(hp, t, qkv.data(), quantized);
      lora.apply(i, lora::kQkv, hp, hidden, qkv.data(), l.qkv->out());
      float *kc = l.k_cache, *vc = l.v_cache;  // a packed cache: fp32 rows 0..t-1 of kv8, packed below
      const int64_t* kv_slots = slots;
      if (l.q8.k) kv8.grow(t, kv_heads * head_dim), kc = kv8.k.data(), vc = kv8.v.data(), kv_slots = kv8.slots.data();
      fused::qkv_rope_store(qkv.data(), positions, l.cos, l.sin, kc, vc, kv_slots, shape, l.q_norm, l.k_norm, eps,
                            q.data());
      if (l.q8.k) {
        kv_q8::store(kc, vc, slots, t, kv_heads, head_dim, l.q8);
        kv_q8::paged_attention(q.data(), l.q8, context, plan, t, heads, kv_heads, head_dim, l.scale, l.window,
                               l.softcap, attn.data(), l.sinks);
      } else {
        attention::paged_attention(q.data(), l.k_cache, l.v_cache, context, plan, t, heads, kv_heads, head_dim,
                                   l.scale, l.window, l.softcap, attn.data(), l.sinks);
      }
      l.o->apply(attn.data(), t, o.data(), quantized);
      lora.apply(i, lora::kO, attn.data(), l.o->in(), o.data(), hidden);
      if (l.attn_out_norm) fused::rms_norm(o.data(), l.attn_out_norm, o.data(), t, hidden, eps);
      fused::add_rms_norm(o.data(), res, l.post_norm, hp, t, hidden, eps);
      if (l.moe) {
        l.moe->apply(hp, t, m.data(), moe_scratch);
      } else {
        const int64_t inner = l.gate_up->out() / 2;
        l.gate_up->apply(hp, t, gate_up.data(), quantized);
        lora.apply(i, lora::kGateUp, hp, hidden, gate_up.data(), l.gate_up->out());
        if (l.gelu)
          fused::gelu_tanh_mul(gate_up.data(), act.data(), t, inner);
        else
          fused::silu_mul(gate_up.data(), act.data(), t, inner);
        l.down->apply(act.data(), t, m.data(), quantized);
        lora.apply(i, lora::kDown, act.data(), inner, m.data(), hidden);
      }
      if (l.mlp_out_norm) fused::rms_norm(m.data(), l.mlp_out_norm, m.data(), t, hidden, eps);
      const bool last = i + 1 == layers.size();
      fused::add_rms_norm(m.data(), res, last ? final_norm : layers[i + 1].input_norm, last ? out : hp, t, hidden, eps);
    }
    return "";
  }
};

}  // namespace runlm::decoder
