"""EXAONE 4: OLMo 2's layer (norms after attention and the MLP, none before; runlm.models.olmo2) with per-head q/k
norms, and with a sliding window its hybrid attention: the sliding-window layers rotate by RoPE, the global ones
(every 4th by default: ``layer_types``) take none (NoPE), as transformers' and llama.cpp's graphs do. llama.cpp's
tensor names are OLMo 2's. Not the native runner's yet (its decoder normalizes each layer's input)."""
from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import Family, global_layers
from runlm.models.families.olmo2 import FAMILY as OLMO2


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    if fields["sliding_window"] is None:  # every layer global, and rotated
        return {}
    types = list(cfg.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                                            for i in range(fields["num_layers"])])
    return {"layer_types": types, "nope_layers": global_layers(types)}


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return {"nope_layers": global_layers(fields["layer_types"])} if fields["sliding_window"] else {}


FAMILY = Family("exaone4", torch_model=OLMO2.torch_model, qk_norm=True, sliding_window=True,
                hf_fields=_hf_fields, gguf_fields=_gguf_fields, gguf_tensor_names=OLMO2.gguf_tensor_names,
                native=False, native_safetensors=False)
