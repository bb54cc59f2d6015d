"""Phi-2 (and Phi-1/1.5): StableLM's parallel layer (runlm.models.stablelm: one LayerNorm feeding attention and MLP)
with an ungated GELU MLP (fc1 -> GELU-tanh -> fc2), biases on every projection and on the output, RoPE on half of
each head (rotating halves). Its checkpoint names (``dense``, ``fc1``/``fc2``, ``final_layernorm``) map to Llama's;
llama.cpp's phi2 files name them as Llama's already. Per-head q/k LayerNorms refused by name. Not the native
runner's, nor the GPU runner's yet (LayerNorm)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.formats import ModelFormatError
from runlm.models.families import Family

_ALWAYS = {"parallel_residual": True, "mlp_bias": True, "lm_head_bias": True, "attention_bias": True}


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("qk_layernorm"):
        raise ModelFormatError("Phi's per-head q/k LayerNorms (qk_layernorm) are not something runlm runs yet")
    return dict(_ALWAYS)


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return dict(_ALWAYS)


FAMILY = Family("phi", torch_model="runlm.models.stablelm:StableLmForCausalLM", layer_norm=True,
                hidden_act="gelu_tanh",
                gated_mlp=False, hf_fields=_hf_fields, gguf_fields=_gguf_fields,
                hf_tensor_names={"self_attn.dense.": "self_attn.o_proj.", "mlp.fc1.": "mlp.up_proj.",
                                 "mlp.fc2.": "mlp.down_proj.", "model.final_layernorm.": "model.norm."},
                native=False, native_safetensors=False)
