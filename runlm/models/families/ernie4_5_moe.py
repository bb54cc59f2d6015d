"""ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B): ERNIE 4.5's layer (RoPE on feature pairs: runlm.models.families.ernie4_5) with
experts from ``moe_layer_start_index`` every ``moe_layer_interval`` layers up to ``moe_layer_end_index``: softmax
scores, a choice bias (``moe_statics``), the chosen weights renormalized, shared experts added ungated. Not the
native runner's (its experts take no choice bias), nor the GPU runner's yet."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runlm.models.families import SHARED_EXPERTS_NAMES, Family


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    layers, size = fields["num_layers"], int(cfg.get("moe_intermediate_size") or 0)
    start, interval = int(cfg.get("moe_layer_start_index", 0)), int(cfg.get("moe_layer_interval", 1))
    end = int(cfg.get("moe_layer_end_index", layers - 1))
    if end < 0:
        end = layers - 1
    return {"num_experts": int(cfg["moe_num_experts"]), "num_experts_per_tok": int(cfg["moe_k"]),
            "shared_expert_intermediate_size": int(cfg.get("moe_num_shared_experts") or 0) * size,
            "dense_layers": [i for i in range(layers) if not (start <= i <= end and (i + 1) % interval == 0)]}


FAMILY = Family("ernie4_5_moe", torch_model="runlm.models.moe:MoeForCausalLM", hf_rope_interleaved=True,
                norm_topk_prob=True, gguf_norm_topk_prob=True, moe_score_bias=True, hf_fields=_hf_fields,
                hf_tensor_names={**SHARED_EXPERTS_NAMES, ".mlp.moe_statics.e_score_correction_bias":
                                 ".mlp.score_bias.bias"},
                native=False, native_safetensors=False)
