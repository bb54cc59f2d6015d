"""Apertus (Swiss AI): Llama's attention with per-head q/k norms, an ungated MLP whose activation is xIELU with
parameters learned per layer (runlm.models.llama.XIELU; llama.cpp keeps them as ``xielu.*`` metadata arrays, one value
per layer), norms named ``attention_layernorm``/``feedforward_layernorm``, Llama 3's RoPE scaling. Not the native
runner's (no xIELU kernel), nor the GPU runner's yet."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runlm.models.families import Family

_XIELU = ("alpha_p", "alpha_n", "beta", "eps")


def _xielu_weights(metadata: Mapping[str, Any], layers: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _XIELU:
        values = metadata[f"xielu.{name}"]
        values = values if isinstance(values, list) else [values] * layers
        for i in range(layers):
            out[f"model.layers.{i}.mlp.act.{name}"] = [values[i]] if name.startswith("alpha") else values[i]
    return out


FAMILY = Family("apertus", qk_norm=True, hidden_act="xielu", gated_mlp=False, gguf_metadata_weights=_xielu_weights,
                hf_tensor_names={".attention_layernorm.": ".input_layernorm.",
                                 ".feedforward_layernorm.": ".post_attention_layernorm.", ".mlp.act_fn.": ".mlp.act."},
                native=False, native_safetensors=False)
