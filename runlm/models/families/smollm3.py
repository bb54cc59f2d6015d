"""SmolLM3: Llama with no RoPE on some layers (NoPE): those whose ``no_rope_layers`` entry is 0, every 4th by
default. llama.cpp's smollm3 files do not list them: its graph skips RoPE on every 4th layer, a fixed step. A
sliding window (``use_sliding_window``) applies to the layers ``layer_types`` names, the NoPE ones by default."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import Family

NO_ROPE_STEP = 4  # llama.cpp's n_no_rope_layer_step; transformers' no_rope_layer_interval by default


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    step = int(cfg.get("no_rope_layer_interval") or NO_ROPE_STEP)
    uses_rope = cfg.get("no_rope_layers") or [int((i + 1) % step != 0) for i in range(fields["num_layers"])]
    out: dict[str, Any] = {"nope_layers": [i for i, rope in enumerate(uses_rope) if not rope]}
    if fields["sliding_window"] is not None:
        out["layer_types"] = list(cfg.get("layer_types") or
                                  ["full_attention" if rope else "sliding_attention" for rope in uses_rope])
    return out


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return {"nope_layers": [i for i in range(fields["num_layers"]) if (i + 1) % NO_ROPE_STEP == 0]}


FAMILY = Family("smollm3", hf_fields=_hf_fields, gguf_fields=_gguf_fields)
