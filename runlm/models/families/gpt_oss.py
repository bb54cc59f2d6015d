"""gpt-oss (OpenAI's open-weight models): runlm.models.stacked_moe says what is particular. Sliding-window layers
alternate with global ones from layer 0 (llama.cpp's fixed pattern of 2). Its YaRN does not truncate the correction
range (its checkpoints' config says ``truncate: false``, OpenAI's reference computes so); a GGUF file cannot say it,
and llama.cpp always truncates, so its files are read with the model's own rotation, not llama.cpp's (the difference
shows in the logits). The native runner runs its GGUF files (attention sinks in its attention, the experts'
biases and clamped SwiGLU in its mixture of experts: csrc/moe_impl.h), and so does the GPU runner (the sinks in
its paged attention kernel; the experts routed on the host, runlm.models.moe.host_routed_experts)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import Family

_FIELDS = {"attention_sinks": True, "router_bias": True, "mlp_bias": True, "norm_topk_prob": True}


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("swiglu_alpha", 1.702) != 1.702:
        raise ValueError(f"gpt-oss with swiglu_alpha {cfg['swiglu_alpha']} (runlm computes 1.702's)")
    return {**_FIELDS, "swiglu_limit": float(cfg.get("swiglu_limit", 7.0))}


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {**_FIELDS, "swiglu_limit": 7.0}  # (llama.cpp's constant)
    if fields["rope_scaling"]:  # gpt-oss's YaRN, which the file cannot say: untruncated
        out["rope_scaling"] = {**fields["rope_scaling"], "truncate": False}
    return out


FAMILY = Family("gpt_oss", torch_model="runlm.models.stacked_moe:GptOssForCausalLM", attention_bias=True,
                sliding_window=True, sliding_pattern=2, hf_fields=_hf_fields, gguf_fields=_gguf_fields,
                hf_tensor_names={".mlp.router.": ".mlp.gate.", ".self_attn.sinks": ".self_attn.sinks.weight"},
                gguf_tensor_names={"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
                native=True, native_safetensors=False)
