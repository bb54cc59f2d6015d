"""Seed-OSS: Llama's layer with q/k/v biases (``attention_bias``, on by default) and none on o_proj; a checkpoint
asking for an o_proj or MLP bias (``attention_out_bias``, ``mlp_bias``, off in the released models) is refused by
name."""
from collections.abc import Mapping
from typing import Any

from runlm.formats import ModelFormatError
from runlm.models.families import Family


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    asked = [key for key in ("attention_out_bias", "mlp_bias") if cfg.get(key)]
    if asked:
        raise ModelFormatError(f"Seed-OSS with {asked[0]} is not supported (released models have none)")
    return {}


# llama.cpp calls the norm before the MLP post_attention_norm here (ffn_norm elsewhere)
FAMILY = Family("seed_oss", attention_bias=True, o_proj_bias=False, hf_fields=_hf_fields,
                gguf_tensor_names={"post_attention_norm": "post_attention_layernorm"})
