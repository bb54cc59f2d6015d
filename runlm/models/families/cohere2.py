"""Cohere 2 (Command R7B): StableLM's parallel layer (runlm.models.stablelm: one norm feeding attention and the MLP)
with LayerNorms without a bias, RoPE rotating feature pairs (2i, 2i+1) on the sliding-window layers only (three of
four; the global ones take none), and the logits scaled by ``logit_scale``. llama.cpp's cohere2 files keep the pairs
layout and name no layer pattern (its graph fixes it at 4). Not the native runner's, nor the GPU runner's yet."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import Family, global_layers

PATTERN = 4  # every 4th layer global (transformers' sliding_window_pattern default; llama.cpp's fixed step)


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return {"norm_bias": False, "parallel_residual": True, "logit_scale": float(cfg.get("logit_scale", 1.0)),
            "nope_layers": global_layers(fields["layer_types"]) if fields["sliding_window"] else []}


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return {"norm_bias": False, "parallel_residual": True, "logit_scale": float(get("logit_scale", 1.0)),
            "nope_layers": global_layers(fields["layer_types"]) if fields["sliding_window"] else []}


FAMILY = Family("cohere2", torch_model="runlm.models.stablelm:StableLmForCausalLM", layer_norm=True,
                hf_rope_interleaved=True, sliding_window=True, sliding_pattern=PATTERN, hf_fields=_hf_fields,
                gguf_fields=_gguf_fields,
                native=False, native_safetensors=False)
