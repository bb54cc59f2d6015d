"""Hunyuan (dense, v1): Llama's layer with per-head q/k norms applied after RoPE, named query_layernorm and
key_layernorm in its checkpoints (attn_q_norm / attn_k_norm in llama.cpp's files). Its released checkpoints label
their RoPE "dynamic" with a fixed ``alpha``: NTK-aware scaling that only stretches the base, to
theta * alpha ** (d / (d - 2)), as transformers computes it. Not the native runner's yet (its decoder normalizes
q/k before rotating)."""
from collections.abc import Mapping
from typing import Any

from runlm.models.families import Family


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    scaling = fields["rope_scaling"] or {}
    if scaling.get("rope_type", scaling.get("type")) != "dynamic" or not scaling.get("alpha"):
        return {}
    d = fields["head_dim"]
    return {"rope_theta": fields["rope_theta"] * float(scaling["alpha"]) ** (d / (d - 2)), "rope_scaling": None}


FAMILY = Family("hunyuan_dense", qk_norm=True, qk_norm_after_rope=True, hf_fields=_hf_fields,
                hf_tensor_names={".query_layernorm.": ".q_norm.", ".key_layernorm.": ".k_norm."})
