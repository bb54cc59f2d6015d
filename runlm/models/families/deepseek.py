"""DeepSeek-V2 (V2-Lite) and DeepSeek-V3 (and Kimi-K2-shaped models): multi-head latent attention (runlm.models.mla:
the cache holds each token's compressed latent, not per-head K/V; RoPE on feature pairs of a separate shared key) and
DeepSeek's mixture of experts after ``first_k_dense_replace`` dense layers, with shared experts added ungated. V2
routes by softmax, greedily or among the best groups by their best expert (``group_limited_greedy``), weights not
renormalized, scaled; V3 by sigmoid with a choice bias among the best groups by their two best experts (runlm.models.
moe). llama.cpp writes both as ``deepseek2``: its metadata says how the file routes (a file without a gating function
is V2's softmax, as llama.cpp reads it), its ``kv_b`` split in ``attn_k_b`` (transposed) and ``attn_v_b``. The
multi-token-prediction layer past ``num_hidden_layers`` is skipped. Not the native runner's; the GPU runner keeps
the latents in its paged cache (one KV head) and attends over them with its Triton kernel."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import SHARED_EXPERTS_NAMES, Family


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    out: dict[str, Any] = {"head_dim": nope + rope, "kv_lora_rank": int(cfg["kv_lora_rank"]),
                           "q_lora_rank": int(cfg.get("q_lora_rank") or 0), "qk_rope_head_dim": rope,
                           "v_head_dim": int(cfg["v_head_dim"]), "partial_rotary_factor": 1.0}
    if cfg.get("rope_interleave") is False:
        raise ValueError("DeepSeek-V3 with rope_interleave false (RoPE on halves) is not supported")
    if "DeepseekV3ForCausalLM" in (cfg.get("architectures") or []) or cfg.get("model_type") == "deepseek_v3":
        out.update(moe_gating="sigmoid", moe_score_bias=True)  # (transformers' V3 router, whatever the config says)
    else:  # V2's router never renormalizes; its groups only under group_limited_greedy, scored by their best expert
        out.update(moe_gating="softmax", norm_topk_prob=False, moe_group_max=True)
        if cfg.get("topk_method", "greedy") != "group_limited_greedy":
            out.update(moe_groups=1, moe_groups_used=1)
    return out


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"head_dim": int(get("attention.key_length_mla")),
                           "kv_lora_rank": int(get("attention.kv_lora_rank")),
                           "q_lora_rank": int(get("attention.q_lora_rank") or 0),
                           "qk_rope_head_dim": int(get("rope.dimension_count")),
                           "v_head_dim": int(get("attention.value_length_mla")),
                           "num_kv_heads": fields["num_heads"], "partial_rotary_factor": 1.0}
    log_mul = get("rope.scaling.yarn_log_multiplier")
    if log_mul and fields["rope_scaling"]:  # the converter writes 0.1 * mscale_all_dim (mscale, as released, equal)
        m = float(log_mul) / 0.1
        out["rope_scaling"] = {**fields["rope_scaling"], "mscale": m, "mscale_all_dim": m}
    return out


FAMILY = Family("deepseek", torch_model="runlm.models.mla:DeepseekForCausalLM", hf_rope_interleaved=True,
                hf_fields=_hf_fields, gguf_fields=_gguf_fields, hf_tensor_names=SHARED_EXPERTS_NAMES,
                gguf_tensor_names={"attn_q_a": "self_attn.q_a_proj", "attn_q_b": "self_attn.q_b_proj",
                                   "attn_q_a_norm": "self_attn.q_a_layernorm",
                                   "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                                   "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_k_b": "self_attn.k_b_proj",
                                   "attn_v_b": "self_attn.v_b_proj", "attn_kv_b": "self_attn.kv_b_proj"},
                native=False, native_safetensors=False)
