"""Bamba: Granite 4's hybrid layers without its multipliers or experts (runlm.models.hybrid): Mamba2 mixers except
on ``attn_layer_indices``, whose attention rotates ``attn_rotary_emb`` features of each head (half by default), and
a dense MLP (``feed_forward``, after ``pre_ff_layernorm``). llama.cpp's converter writes it as a ``granitehybrid``
file (with RoPE), which loads as Granite 4's family. Not the native runner's, nor the GPU runner's yet."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runlm.models.families import Family
from runlm.models.families.granitemoehybrid import mamba2_fields


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    attention = set(cfg.get("attn_layer_indices") or [])
    out = mamba2_fields(cfg, [i for i in range(fields["num_layers"]) if i not in attention])
    rotary = cfg.get("attn_rotary_emb")
    out["partial_rotary_factor"] = int(rotary) / fields["head_dim"] if rotary else 0.5  # (transformers' fixed half)
    return out


FAMILY = Family("bamba", torch_model="runlm.models.hybrid:HybridForCausalLM", hf_fields=_hf_fields,
                hf_tensor_names={".feed_forward.": ".mlp.", ".pre_ff_layernorm.": ".post_attention_layernorm.",
                                 "model.final_layernorm.": "model.norm."},
                native=False, native_safetensors=False)
