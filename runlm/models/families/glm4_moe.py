"""GLM-4.5 (GLM-4.5-Air, GLM-4.6): Llama's layer with q/k/v biases, optional per-head q/k norms (``use_qk_norm``) and
RoPE over part of each head (halves rotated, as transformers and llama.cpp's ``glm4moe`` files both store it), then
DeepSeek-V3's mixture of experts: sigmoid scores, a choice bias, the choice among the best groups of experts, the
weights renormalized and scaled, one shared expert added ungated, the first ``first_k_dense_replace`` layers dense.
The checkpoints' multi-token-prediction layers (past ``num_hidden_layers``; counted in the GGUF ``block_count``, less
``nextn_predict_layers``) are not the decoder's. Not the native runner's (its experts route by softmax), nor the GPU
runner's yet."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runlm.models.families import SHARED_EXPERTS_NAMES, Family


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return {"qk_norm": bool(cfg.get("use_qk_norm", False))}


FAMILY = Family("glm4_moe", torch_model="runlm.models.moe:MoeForCausalLM", o_proj_bias=False, moe_gating="sigmoid",
                moe_score_bias=True, hf_fields=_hf_fields, hf_tensor_names=SHARED_EXPERTS_NAMES,
                gguf_tensor_names={"post_attention_norm": "post_attention_layernorm"}, native=False,
                native_safetensors=False)
