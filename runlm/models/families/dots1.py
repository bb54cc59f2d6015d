"""dots.llm1 (rednote): Qwen3's attention (per-head q/k norms; sliding-window layers where ``layer_types`` says) and
DeepSeek-V3's mixture of experts (runlm.models.families.glm4_moe says which). Not the native runner's (its experts
route by softmax), nor the GPU runner's yet."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runlm.models.families import SHARED_EXPERTS_NAMES, Family


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    types = cfg.get("layer_types")
    if not types or "sliding_attention" not in types:
        return {"sliding_window": None}
    return {"layer_types": list(types), "sliding_window": cfg.get("sliding_window")}


FAMILY = Family("dots1", torch_model="runlm.models.moe:MoeForCausalLM", qk_norm=True, moe_gating="sigmoid",
                moe_score_bias=True, hf_fields=_hf_fields, hf_tensor_names=SHARED_EXPERTS_NAMES, native=False,
                native_safetensors=False)
