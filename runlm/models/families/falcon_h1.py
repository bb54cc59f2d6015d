"""Falcon-H1: attention and a Mamba2 mixer side by side in every layer (runlm.models.falcon_h1), a SwiGLU MLP, µP
multipliers folded into the weights on loading (llama.cpp's converter folds them into its ``falcon-h1`` files). The
Mamba2 mixers keep a state per sequence: no prefix caching, no speculation. Not the native runner's, nor the GPU
runner's yet."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import Family
from runlm.models.families.granitemoehybrid import mamba2_fields, mamba2_gguf_fields

# the HF config's multipliers the model folds into its weights (the embeddings' and the logits' are config fields)
_FOLDED = ("attention_in_multiplier", "attention_out_multiplier", "key_multiplier", "ssm_in_multiplier",
           "ssm_out_multiplier", "mlp_multipliers", "ssm_multipliers")


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    heads = int(cfg["mamba_n_heads"])
    names = dict(cfg)
    if cfg.get("mamba_d_head") in (None, "auto") and cfg.get("mamba_d_ssm"):
        names["mamba_d_head"] = int(cfg["mamba_d_ssm"]) // heads
    out = mamba2_fields(names, list(range(fields["num_layers"])))
    norm = "none" if not cfg.get("mamba_rms_norm") else \
        "before_gate" if cfg.get("mamba_norm_before_gate", True) else "after_gate"
    return {**out, "parallel_mixers": True, "ssm_norm": norm,
            "embed_scale": float(cfg.get("embedding_multiplier") or 1.0),
            "logit_scale": float(cfg.get("lm_head_multiplier") or 1.0),
            "multipliers": {k: cfg[k] for k in _FOLDED if cfg.get(k) is not None}}


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    # (llama.cpp's files carry no mixer norm for it to read: a file with ssm_norm tensors is refused on loading)
    return {**mamba2_gguf_fields(get, fields), "recurrent_layers": list(range(fields["num_layers"])),
            "parallel_mixers": True, "ssm_norm": "none"}


FAMILY = Family("falcon_h1", torch_model="runlm.models.falcon_h1:FalconH1ForCausalLM", hf_fields=_hf_fields,
                gguf_fields=_gguf_fields,
                hf_tensor_names={".feed_forward.": ".mlp.", ".pre_ff_layernorm.": ".post_attention_layernorm.",
                                 "model.final_layernorm.": "model.norm."},
                native=False, native_safetensors=False)
