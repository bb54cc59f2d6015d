// runlm's kernels as a plain C ABI (no torch, no pybind11, no Python headers) for the torch-free
// runner: runlm/native/build.py compiles this file with the system compiler, runlm/native/kernels.py
// calls it through ctypes over numpy arrays. The compute is the torch extensions' own (the *_impl.h
// headers), threaded by OpenMP instead of at::parallel_for, so results are the same bits.
//
// Conventions: arrays are C-contiguous, dims are int64. A function returning int gives 0 on success
// and -1 on an error whose message runlm_last_error() then holds (per calling thread); shapes and
// dtypes are checked by the Python side, values (ids, positions, slots, lengths) here.
#include <cstdint>
#include <string>
#include <vector>

#include "attention_impl.h"
#include "fused_ops_impl.h"
#include "ggml_linear_impl.h"
#include "kv_q8_impl.h"
#include "moe_impl.h"
#include "native_decoder.h"

namespace {

namespace gl = runlm::ggml_linear;
namespace fused = runlm::fused;
namespace attn = runlm::attention;
using runlm::decoder::Decoder;
using runlm::decoder::Layer;
using runlm::decoder::Weights;
using runlm::moe::Experts;

thread_local std::string g_error;

int fail(const std::string& message) {
  g_error = message;
  return -1;
}

int status(const std::string& message) { return message.empty() ? 0 : fail(message); }

}  // namespace

extern "C" {

const char* runlm_last_error() { return g_error.c_str(); }

// ggml's fp16 tables and CPU feature probe, which the dot products rely on. Call once, first.
void runlm_init() { ggml_cpu_init(); }

void runlm_set_threads(int n) {
  runlm::g_threads.store(n > 0 ? n : 0);
}

int runlm_get_threads() { return runlm::threads(); }

const char* runlm_cpu_features() {
  static const std::string features = gl::cpu_features();
  return features.c_str();
}

int runlm_supported(int64_t type) { return gl::supported(type) ? 1 : 0; }
int64_t runlm_row_bytes(int64_t type, int64_t k) { return gl::row_bytes(type, k); }
int64_t runlm_block_size(int64_t type) { return gl::block_size(type); }

// A linear layer's handle: n segments (data, rows, row_bytes, type), K columns, an optional bias.
// Null on a bad segment (runlm_last_error says why).
void* runlm_linear_new(int64_t n, const uint8_t* const* data, const int64_t* rows, const int64_t* row_bytes,
                       const int64_t* types, int64_t k, const float* bias) {
  std::vector<gl::Segment> segs;
  for (int64_t s = 0; s < n; ++s) segs.push_back({data[s], rows[s], row_bytes[s], types[s]});
  auto* w = new Weights;
  const std::string bad = gl::make_plan(std::move(segs), k, false, w->plan, /*pack=*/true);
  if (!bad.empty()) {
    delete w;
    fail(bad);
    return nullptr;
  }
  w->bias = bias;
  return w;
}

void runlm_linear_free(void* w) { delete static_cast<Weights*>(w); }

// Whether segment s was repacked (its rows as given are not read again by the layer).
int runlm_linear_packed(const void* w, int64_t s) {
  const gl::Plan& p = static_cast<const Weights*>(w)->plan;
  return s >= 0 && s < static_cast<int64_t>(p.packed.size()) && p.packed[static_cast<size_t>(s)] ? 1 : 0;
}

int runlm_linear(const void* handle, const float* x, int64_t m, float* y) {
  thread_local gl::Scratch scratch;
  static_cast<const Weights*>(handle)->apply(x, m, y, scratch);
  return 0;
}

int runlm_embedding(const int64_t* ids, int64_t t, const uint8_t* table, int64_t v, int64_t row_bytes, int64_t type,
                    int64_t k, float* out) {
  std::string bad = gl::check_segment(type, k, row_bytes);
  if (bad.empty()) bad = gl::check_ids(ids, t, v);
  if (!bad.empty()) return fail(bad);
  gl::embedding(ids, t, table, row_bytes, type, k, out);
  return 0;
}

int runlm_dequantize(const uint8_t* table, int64_t n, int64_t row_bytes, int64_t type, int64_t k, float* out) {
  const std::string bad = gl::check_segment(type, k, row_bytes);
  if (!bad.empty()) return fail(bad);
  gl::dequantize(table, n, row_bytes, type, k, out);
  return 0;
}

void runlm_rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps) {
  fused::rms_norm(x, w, out, rows, n, eps);
}

void runlm_add_rms_norm(const float* x, float* residual, const float* w, float* out, int64_t rows, int64_t n,
                        float eps) {
  fused::add_rms_norm(x, residual, w, out, rows, n, eps);
}

void runlm_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inner) {
  fused::silu_mul(gate_up, out, rows, inner);
}

void runlm_gelu_tanh_mul(const float* gate_up, float* out, int64_t rows, int64_t inner) {
  fused::gelu_tanh_mul(gate_up, out, rows, inner);
}

int runlm_qkv_rope_store(const float* qkv, const int64_t* positions, const float* cos, const float* sin,
                         int64_t table_rows, float* k_cache, float* v_cache, int64_t cache_slots,
                         const int64_t* slot_mapping, int64_t t, int64_t heads, int64_t kv_heads, int64_t d,
                         int interleaved, const float* q_norm, const float* k_norm, float eps, float* q) {
  const fused::QkvShape shape{t, heads, kv_heads, d, table_rows, cache_slots, interleaved != 0};
  const std::string bad = fused::check_qkv_rows(shape, positions, slot_mapping);
  if (!bad.empty()) return fail(bad);
  fused::qkv_rope_store(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, shape, q_norm, k_norm, eps, q);
  return 0;
}

// 0: out written; 1: not covered (a CPU without AVX2/FMA); -1: bad lengths.
int runlm_paged_attention(const float* q, const float* k_cache, const float* v_cache, int64_t cache_slots,
                          const int64_t* slots, int64_t n_slots, const int64_t* query_lens,
                          const int64_t* context_lens, int64_t batch, int64_t t, int64_t heads, int64_t kv_heads,
                          int64_t d, float scale, int64_t window, float softcap, float* out) {
  if (!attn::cpu_supported()) return 1;
  if (kv_heads <= 0 || heads % kv_heads != 0) return fail("runlm attention: head shapes do not match");
  for (int64_t i = 0; i < n_slots; ++i)
    if (slots[i] < 0 || slots[i] >= cache_slots)
      return fail("context slot " + std::to_string(slots[i]) + " is outside the cache");
  thread_local attn::RowPlan plan;
  const std::string bad = attn::plan_rows(query_lens, context_lens, batch, t, n_slots, plan);
  if (!bad.empty()) return fail(bad);
  attn::paged_attention(q, k_cache, v_cache, slots, plan, t, heads, kv_heads, d, scale, window, softcap, out);
  return 0;
}

void* runlm_decoder_new(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps, int interleaved,
                        const uint8_t* embed, int64_t vocab, int64_t embed_row_bytes, int64_t embed_type,
                        float embed_scale, const float* final_norm, int64_t n_layers) {
  const std::string bad = gl::check_segment(embed_type, hidden, embed_row_bytes);
  if (!bad.empty()) {
    fail("embedding table: " + bad);
    return nullptr;
  }
  if (kv_heads <= 0 || heads % kv_heads != 0 || n_layers <= 0) {
    fail("a decoder needs heads a multiple of kv_heads and at least one layer");
    return nullptr;
  }
  auto* dec = new Decoder{hidden, heads, kv_heads, head_dim, eps, interleaved != 0, embed, vocab, embed_row_bytes,
                          embed_type, embed_scale, final_norm, std::vector<Layer>(static_cast<size_t>(n_layers))};
  return dec;
}

void runlm_decoder_free(void* dec) { delete static_cast<Decoder*>(dec); }

// Layer i's weights (handles from runlm_linear_new) and settings; norms may be null where absent.
// act: 0 silu, 1 gelu_tanh. window 0 / softcap 0: none.
int runlm_decoder_set_layer(void* handle, int64_t i, const void* qkv, const void* o, const void* gate_up,
                            const void* down, const float* input_norm, const float* post_norm, const float* q_norm,
                            const float* k_norm, const float* attn_out_norm, const float* mlp_out_norm,
                            const float* cos, const float* sin, int64_t rope_rows, float scale, int64_t window,
                            float softcap, int act) {
  auto* dec = static_cast<Decoder*>(handle);
  if (i < 0 || i >= static_cast<int64_t>(dec->layers.size())) return fail("no layer " + std::to_string(i));
  Layer& l = dec->layers[static_cast<size_t>(i)];
  l.qkv = static_cast<const Weights*>(qkv), l.o = static_cast<const Weights*>(o);
  l.gate_up = static_cast<const Weights*>(gate_up), l.down = static_cast<const Weights*>(down);
  l.input_norm = input_norm, l.post_norm = post_norm, l.q_norm = q_norm, l.k_norm = k_norm;
  l.attn_out_norm = attn_out_norm, l.mlp_out_norm = mlp_out_norm;
  l.cos = cos, l.sin = sin, l.rope_rows = rope_rows;
  l.scale = scale, l.window = window, l.softcap = softcap, l.gelu = act == 1;
  dec->rows = 0;  // the MLP may have grown: size the scratch again
  return 0;
}

int runlm_decoder_set_cache(void* handle, int64_t i, float* k_cache, float* v_cache, int64_t cache_slots) {
  auto* dec = static_cast<Decoder*>(handle);
  if (i < 0 || i >= static_cast<int64_t>(dec->layers.size())) return fail("no layer " + std::to_string(i));
  Layer& l = dec->layers[static_cast<size_t>(i)];
  l.k_cache = k_cache, l.v_cache = v_cache, l.cache_slots = cache_slots, l.q8 = {};
  return 0;
}

// Layer i's KV cache packed (kv_q8_impl.h): fp16 rows where ``half`` (k/v [cache_slots, kv_heads, head_dim]
// halves), else q8_0 blocks (k/v [cache_slots, kv_heads, head_dim / 32 * 34] bytes).
int runlm_decoder_set_cache_packed(void* handle, int64_t i, uint8_t* k_cache, uint8_t* v_cache, int64_t cache_slots,
                                   int half) {
  auto* dec = static_cast<Decoder*>(handle);
  if (i < 0 || i >= static_cast<int64_t>(dec->layers.size())) return fail("no layer " + std::to_string(i));
  const std::string bad = half ? "" : runlm::kv_q8::check_head_dim(dec->head_dim);
  if (!bad.empty()) return fail(bad);
  Layer& l = dec->layers[static_cast<size_t>(i)];
  l.k_cache = nullptr, l.v_cache = nullptr, l.q8 = {k_cache, v_cache, half != 0}, l.cache_slots = cache_slots;
  return 0;
}

// n rows of d floats (d a multiple of 32) into q8_0 blocks [n, d / 32 * 34], as the q8_0 KV cache stores them.
int runlm_kv_q8_quantize(const float* x, int64_t n, int64_t d, uint8_t* out) {
  const std::string bad = runlm::kv_q8::check_head_dim(d);
  if (!bad.empty()) return fail(bad);
  for (int64_t r = 0; r < n; ++r) runlm::kv_q8::quantize_row(x + r * d, out + r * runlm::kv_q8::row_bytes(d), d);
  return 0;
}

// Layer i's settings beyond the Llama layer's (after its runlm_decoder_set_layer): rotary, the features of
// each head RoPE rotates (the cos/sin tables' width; 0: all), even and at most head_dim; qk_norm_whole: its
// q_norm [H D] and k_norm [KVH D] normalize the whole projection; group: the KV group holding its K/V (0:
// the step's own slots, g > 0: the g-th of runlm_decoder_forward_groups' groups).
int runlm_decoder_set_layer_family(void* handle, int64_t i, int64_t rotary, int qk_norm_whole, int64_t group) {
  auto* dec = static_cast<Decoder*>(handle);
  if (i < 0 || i >= static_cast<int64_t>(dec->layers.size())) return fail("no layer " + std::to_string(i));
  if (rotary < 0 || rotary > dec->head_dim || rotary % 2 != 0)
    return fail("rotary features must be even and at most head_dim, not " + std::to_string(rotary));
  if (group < 0) return fail("a KV group is 0 or more, not " + std::to_string(group));
  dec->layers[static_cast<size_t>(i)].fam = {rotary, qk_norm_whole != 0, group};
  return 0;
}

// Checks that every layer is set and its shapes fit; call once after the set_layer calls.
int runlm_decoder_check(const void* handle) { return status(static_cast<const Decoder*>(handle)->check()); }

int runlm_decoder_forward(void* handle, const int64_t* ids, const int64_t* positions, const int64_t* slot_mapping,
                          int64_t t, const int64_t* query_lens, const int64_t* context_lens, int64_t batch,
                          const int64_t* flat_slots, int64_t n_flat, float* out) {
  return status(static_cast<Decoder*>(handle)->forward(ids, positions, slot_mapping, t, query_lens, context_lens,
                                                       batch, flat_slots, n_flat, out));
}

// runlm_decoder_forward with n_embeds rows (embed_rows, in [0, t)) taking embed_values [n_embeds, hidden]
// over their token embeddings: a vision-language model's image rows.
int runlm_decoder_forward_embeds(void* handle, const int64_t* ids, const int64_t* positions,
                                 const int64_t* slot_mapping, int64_t t, const int64_t* query_lens,
                                 const int64_t* context_lens, int64_t batch, const int64_t* flat_slots, int64_t n_flat,
                                 float* out, const int64_t* embed_rows, const float* embed_values, int64_t n_embeds) {
  return status(static_cast<Decoder*>(handle)->forward(ids, positions, slot_mapping, t, query_lens, context_lens,
                                                       batch, flat_slots, n_flat, out, embed_rows, embed_values,
                                                       n_embeds));
}

// LoRA (csrc/lora_impl.h). Adapter key's update of layer i's projection proj (0 qkv, 1 o, 2 gate_up, 3 down):
// a [rank, in] (the projection's input width), shards [n_shards, 4] (output columns lo, hi; rows r0, r1 of a),
// their B matrices transposed, [r1 - r0, hi - lo], one after another in b; half: a and b hold fp16, else fp32
// values. The arrays stay the caller's, kept alive.
int runlm_decoder_set_lora(void* handle, int64_t key, int64_t i, int proj, const void* a, int64_t rank, int64_t in,
                           int64_t n_shards, const int64_t* shards, const void* b, int half) {
  auto* dec = static_cast<Decoder*>(handle);
  if (i < 0 || i >= static_cast<int64_t>(dec->layers.size())) return fail("no layer " + std::to_string(i));
  const Layer& l = dec->layers[static_cast<size_t>(i)];
  const Weights* w = proj == 0 ? l.qkv : proj == 1 ? l.o : proj == 2 ? l.gate_up : proj == 3 ? l.down : nullptr;
  if (w && w->in() != in)
    return fail("LoRA A has " + std::to_string(in) + " columns, the projection takes " + std::to_string(w->in()));
  return status(dec->lora.set(key, dec->layers.size(), static_cast<size_t>(i), proj, a, rank, in, w ? w->out() : 0,
                              n_shards, shards, b, half != 0));
}

void runlm_decoder_drop_lora(void* handle, int64_t key) { static_cast<Decoder*>(handle)->lora.drop(key); }

// Each of the next steps' t rows' adapter key (0: none); t == 0: no adapters.
int runlm_decoder_set_lora_rows(void* handle, const int64_t* keys, int64_t t) {
  return status(static_cast<Decoder*>(handle)->lora.set_rows(keys, t));
}

// A mixture of experts' handle: n_experts of which each token takes top_k (renormalize: their weights
// rescaled to sum to 1); the router [E, hidden] of router_type (0: fp32); stacked expert tensors gate and
// up [E, I, hidden], or gate [E, 2I, hidden] with up null (merged, the gate's rows first), down [E, hidden, I];
// act 0 silu, 1 gelu_tanh. Null on bad shapes or types (runlm_last_error says why).
void* runlm_moe_new(int64_t n_experts, int64_t top_k, int renormalize, int64_t hidden, int64_t inner,
                    const uint8_t* router, int64_t router_type, const uint8_t* gate, int64_t gate_type,
                    const uint8_t* up, int64_t up_type, const uint8_t* down, int64_t down_type, int act) {
  auto* moe = new Experts;
  moe->n_experts = n_experts, moe->top_k = top_k, moe->hidden = hidden, moe->inner = inner;
  moe->renormalize = renormalize != 0, moe->gelu = act == 1;
  std::string bad;
  if (router_type == 0) {
    moe->router_f32 = reinterpret_cast<const float*>(router);
  } else {
    bad = gl::make_plan({{router, n_experts, gl::row_bytes(router_type, hidden), router_type}}, hidden, false,
                        moe->router_plan);
    if (!bad.empty()) bad = "router: " + bad;
  }
  const int64_t gate_rows = up ? inner : 2 * inner;
  if (bad.empty())
    bad = moe->build({gate, gate_type, gate_rows, hidden}, {up, up_type, inner, hidden}, {down, down_type, hidden, inner});
  if (!bad.empty()) {
    delete moe;
    fail(bad);
    return nullptr;
  }
  return moe;
}

void runlm_moe_free(void* moe) { delete static_cast<Experts*>(moe); }

// The always-on shared expert (linear handles: gate_up [2 S, hidden], down [hidden, S]) and its gate
// [hidden] (null: ungated), as Qwen2-MoE has.
int runlm_moe_set_shared(void* handle, const void* gate_up, const void* down, const float* gate) {
  auto* moe = static_cast<Experts*>(handle);
  const auto *gu = static_cast<const Weights*>(gate_up), *dn = static_cast<const Weights*>(down);
  if (!gu || !dn || gu->in() != moe->hidden || gu->out() % 2 != 0 || dn->in() != gu->out() / 2 ||
      dn->out() != moe->hidden)
    return fail("shared expert: gate_up must be [2 S, hidden] and down [hidden, S]");
  moe->shared_gate_up = &gu->plan, moe->shared_down = &dn->plan, moe->shared_gate = gate;
  return 0;
}

// gpt-oss's experts: the router's bias [E], each expert's gate_up bias [E, 2I] (the gate's, then the up's) and
// down bias [E, hidden] (each may be null), and its clamped SwiGLU's limit (> 0).
int runlm_moe_set_oai(void* handle, const float* router_bias, const float* gate_up_bias, const float* down_bias,
                      float swiglu_limit) {
  auto* moe = static_cast<Experts*>(handle);
  if (!(swiglu_limit > 0.0f)) return fail("the clamped SwiGLU's limit must be above 0");
  moe->router_bias = router_bias, moe->gate_up_bias = gate_up_bias, moe->down_bias = down_bias;
  moe->swiglu_limit = swiglu_limit;
  return 0;
}

// Layer i's attention sinks: one logit per query head [heads] (gpt-oss), or null for none.
int runlm_decoder_set_layer_sinks(void* handle, int64_t i, const float* sinks) {
  auto* dec = static_cast<Decoder*>(handle);
  if (i < 0 || i >= static_cast<int64_t>(dec->layers.size())) return fail("no layer " + std::to_string(i));
  dec->layers[static_cast<size_t>(i)].sinks = sinks;
  return 0;
}

// out [t, hidden] = the mixture of experts on x [t, hidden] (the op alone, for tests).
int runlm_moe_forward(const void* handle, const float* x, int64_t t, float* out) {
  thread_local runlm::moe::Scratch scratch;
  static_cast<const Experts*>(handle)->apply(x, t, out, scratch);
  return 0;
}

// Layer i's MLP becomes the mixture of experts `moe` (from runlm_moe_new); its gate_up / down may be null.
int runlm_decoder_set_layer_moe(void* handle, int64_t i, const void* moe) {
  auto* dec = static_cast<Decoder*>(handle);
  if (i < 0 || i >= static_cast<int64_t>(dec->layers.size())) return fail("no layer " + std::to_string(i));
  dec->layers[static_cast<size_t>(i)].moe = static_cast<const Experts*>(moe);
  return 0;
}

// runlm_decoder_forward_embeds with the slots of n_groups KV groups after the first (layers whose group is
// g >= 1 write to group_slot_maps[(g - 1) t ...] and read group_flat[(g - 1) n_flat ...]): Gemma's
// sliding-window layers, whose cache is their own. n_embeds may be 0 (embed_rows, embed_values null).
int runlm_decoder_forward_groups(void* handle, const int64_t* ids, const int64_t* positions,
                                 const int64_t* slot_mapping, int64_t t, const int64_t* query_lens,
                                 const int64_t* context_lens, int64_t batch, const int64_t* flat_slots, int64_t n_flat,
                                 float* out, const int64_t* embed_rows, const float* embed_values, int64_t n_embeds,
                                 int64_t n_groups, const int64_t* group_slot_maps, const int64_t* group_flat) {
  if (n_groups < 0) return fail("a negative number of KV groups");
  const runlm::decoder::GroupSlots groups{n_groups, group_slot_maps, group_flat};
  return status(static_cast<Decoder*>(handle)->forward(ids, positions, slot_mapping, t, query_lens, context_lens,
                                                       batch, flat_slots, n_flat, out, embed_rows, embed_values,
                                                       n_embeds, groups));
}

}  // extern "C"
