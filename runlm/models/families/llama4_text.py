"""Llama 4's text decoder (``Llama4ForCausalLM``, ``llama4_text``): chunked local attention on its RoPE layers
(``attention_chunk_size``: a position sees only its own chunk), global attention without RoPE on every fourth layer
(``no_rope_layers``) with queries scaled up with the position (attention temperature tuning), weightless q/k norms
after RoPE on the RoPE layers, RoPE on feature pairs; a mixture of experts every ``interleave_moe_layer_step`` layers
(``moe_layers``), routed by the sigmoid of each token's top-k logits scaling the chosen experts' *inputs*, beside an
ungated shared expert; dense layers ``intermediate_size_mlp`` wide (runlm.models.stacked_moe.Llama4ForCausalLM).
llama.cpp's ``llama4`` files say none of the attention's constants: they are read as llama.cpp fixes them (chunks
of 8192, every fourth layer global without RoPE, floor_scale 8192, attn_scale 0.1; none of it where the file's
sliding_window is 0). Not the native runner's; the GPU runner's (the chunks in its paged attention kernel, the
experts routed on the host: runlm.models.moe.host_routed_experts)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import Family


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    layers = fields["num_layers"]
    step = int(cfg.get("interleave_moe_layer_step") or 1)
    moe = cfg.get("moe_layers") or [i for i in range(layers) if (i + 1) % step == 0]
    rope = cfg.get("no_rope_layers") or [int((i + 1) % int(cfg.get("no_rope_layer_interval", 4)) != 0)
                                         for i in range(layers)]  # (1: the layer rotates)
    chunk = cfg.get("attention_chunk_size")
    types = cfg.get("layer_types") or ["chunked_attention" if chunk and r else "full_attention" for r in rope]
    experts_size = int(cfg["intermediate_size"])
    tuning = cfg.get("attn_temperature_tuning", True)
    return {"intermediate_size": int(cfg.get("intermediate_size_mlp") or experts_size),
            "moe_intermediate_size": experts_size, "shared_expert_intermediate_size": experts_size,
            "dense_layers": [i for i in range(layers) if i not in moe], "nope_layers": [i for i, r in enumerate(rope)
                                                                                        if not r],
            "moe_gating": "sigmoid", "moe_weight_input": True, "norm_topk_prob": False,
            "qk_l2_norm": bool(cfg.get("use_qk_norm", True)), "layer_types": list(types),
            "attention_chunk": int(chunk) if chunk else None,
            "attn_floor_scale": float(cfg.get("floor_scale", 8192)) if tuning else 0.0,
            "attn_temperature_scale": float(cfg.get("attn_scale", 0.1)) if tuning else 0.0}


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    layers = fields["num_layers"]
    plain = get("attention.sliding_window") == 0  # (llama.cpp: no chunks, RoPE everywhere)
    out: dict[str, Any] = {"moe_gating": "sigmoid", "moe_weight_input": True, "norm_topk_prob": False,
                           "qk_l2_norm": True}
    if not plain:
        out.update(layer_types=["chunked_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
                   nope_layers=[i for i in range(layers) if (i + 1) % 4 == 0], attention_chunk=8192,
                   attn_floor_scale=8192.0, attn_temperature_scale=0.1)
    return out


FAMILY = Family("llama4_text", torch_model="runlm.models.stacked_moe:Llama4ForCausalLM", hf_rope_interleaved=True,
                hf_fields=_hf_fields, gguf_fields=_gguf_fields,
                hf_tensor_names={".feed_forward.router.": ".mlp.gate.", ".feed_forward.": ".mlp."},
                native=False, native_safetensors=False)
