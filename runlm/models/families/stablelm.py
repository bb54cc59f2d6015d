"""StableLM (2): Llama's layer with LayerNorm (weight and bias) in place of RMSNorm, RoPE on the first quarter of each
head (partial rotary, rotating halves), q/k/v biases where ``use_qkv_bias``, and optionally the parallel residual
(one norm feeding attention and MLP). Per-head q/k LayerNorms (``qk_layernorm``, StableLM 2 12B) are refused by name.
Not the native runner's (its decoder's norms are RMSNorm), nor the GPU runner's yet."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.formats import ModelFormatError
from runlm.models.families import Family


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("qk_layernorm"):
        raise ModelFormatError("StableLM's per-head q/k LayerNorms (qk_layernorm) are not something runlm runs yet")
    return {"attention_bias": bool(cfg.get("use_qkv_bias")),
            "parallel_residual": bool(cfg.get("use_parallel_residual", False))}


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return {"parallel_residual": bool(get("use_parallel_residual", False))}


FAMILY = Family("stablelm", torch_model="runlm.models.stablelm:StableLmForCausalLM", layer_norm=True,
                o_proj_bias=False,
                hf_fields=_hf_fields, gguf_fields=_gguf_fields, native=False, native_safetensors=False)
