"""Qwen3-Next (and the Qwen3.5 models built like it): gated DeltaNet linear attention (``linear_attention`` layers,
runlm.models.gated_delta: a state per sequence, no prefix caching, no speculation) beside gated attention with
per-head q/k norms and partial RoPE, Qwen2-MoE's experts (softmax top-k, a sigmoid-gated shared expert), (1 + w)
RMSNorms. Not the native runner's, nor the GPU runner's yet."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import Family


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % int(cfg.get("full_attention_interval") or 4) == 0
                                       else "linear_attention" for i in range(fields["num_layers"])]
    return dict(recurrent_layers=[i for i, t in enumerate(types) if t == "linear_attention"],
                recurrent_kind="gated_delta", attn_output_gate=True,
                ssm_heads=int(cfg["linear_num_value_heads"]), ssm_groups=int(cfg["linear_num_key_heads"]),
                ssm_head_dim=int(cfg["linear_key_head_dim"]), ssm_state=int(cfg["linear_value_head_dim"]),
                ssm_conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4), ssm_conv_bias=False)


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """llama.cpp's: which layers are recurrent, the DeltaNet's heads (``time_step_rank`` value heads, ``group_count``
    key heads of ``state_size``; values ``inner_size`` wide in all)."""
    recurrent = get("attention.recurrent_layers")
    interval = int(get("full_attention_interval") or 4)
    layers = fields["num_layers"]
    heads = int(get("ssm.time_step_rank"))
    return dict(recurrent_layers=[i for i in range(layers) if (recurrent[i] if recurrent else (i + 1) % interval)],
                recurrent_kind="gated_delta", attn_output_gate=True, ssm_heads=heads,
                ssm_groups=int(get("ssm.group_count")), ssm_head_dim=int(get("ssm.state_size")),
                ssm_state=int(get("ssm.inner_size")) // heads, ssm_conv_kernel=int(get("ssm.conv_kernel") or 4),
                ssm_conv_bias=False)


_GGUF = {"attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
         "ssm_ba": "linear_attn.in_proj_ba", "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
         "ssm_out": "linear_attn.out_proj", "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
         "post_attention_norm": "post_attention_layernorm"}

FAMILY = Family("qwen3_next", torch_model="runlm.models.qwen3_next:Qwen3NextForCausalLM", qk_norm=True,
                hf_norm_offset=1.0, shared_expert_gate=True, norm_topk_prob=True, gguf_norm_topk_prob=True,
                hf_fields=_hf_fields, gguf_fields=_gguf_fields, gguf_tensor_names=_GGUF, native=False,
                native_safetensors=False)
