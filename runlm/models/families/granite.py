"""Granite 3: Llama's layer with four multipliers (runlm.models.granite): the embeddings', each layer's residual
branches', the attention's score scale (instead of head_dim ** -0.5) and the logits' divisor. llama.cpp stores them as
``granite.embedding_scale``, ``residual_scale``, ``attention.scale`` and ``logit_scale``, its Q/K interleaved as
Llama's. Not the native runner's (its decoder adds branches unscaled), nor the GPU runner's yet."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import Family


def _scales(embedding: Any, residual: Any, attention: Any, logits: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"embed_scale": float(embedding if embedding is not None else 1.0),
                           "residual_scale": float(residual if residual is not None else 1.0),
                           "logit_scale": 1.0 / float(logits or 1.0)}
    if attention:  # the score scale itself: query_pre_attn_scalar ** -0.5 == attention
        out["query_pre_attn_scalar"] = float(attention) ** -2
    return out


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return _scales(cfg.get("embedding_multiplier"), cfg.get("residual_multiplier"), cfg.get("attention_multiplier"),
                   cfg.get("logits_scaling"))


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return _scales(get("embedding_scale"), get("residual_scale"), get("attention.scale"), get("logit_scale"))


FAMILY = Family("granite", torch_model="runlm.models.granite:GraniteForCausalLM", hf_fields=_hf_fields,
                gguf_fields=_gguf_fields, native=False, native_safetensors=False)
