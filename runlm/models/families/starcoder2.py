"""StarCoder2: StableLM's sequential LayerNorm layer (runlm.models.stablelm) with an ungated GELU MLP (``c_fc`` ->
GELU-tanh -> ``c_proj``), biases on every projection where ``use_bias`` (its default), a sliding window over every
layer where the config sets one. llama.cpp's starcoder2 files name the tensors as Llama's. Not the native runner's,
nor the GPU runner's yet (LayerNorm)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import Family


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("use_bias", True))
    return {"attention_bias": bias, "mlp_bias": bias}


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return {"mlp_bias": fields["attention_bias"]}


FAMILY = Family("starcoder2", torch_model="runlm.models.stablelm:StableLmForCausalLM", layer_norm=True,
                hidden_act="gelu_tanh",
                gated_mlp=False, sliding_window=True, hf_fields=_hf_fields, gguf_fields=_gguf_fields,
                hf_tensor_names={"mlp.c_fc.": "mlp.up_proj.", "mlp.c_proj.": "mlp.down_proj."},
                native=False, native_safetensors=False)
