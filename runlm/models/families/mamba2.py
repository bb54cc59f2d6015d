"""Mamba2 (``Mamba2ForCausalLM``, Codestral Mamba): every layer a Mamba2 mixer alone (runlm.models.nemotron_h's
one-mixer layers), no attention: no KV cache at all, only a recurrent state per sequence, so a context costs the same
memory at any length. llama.cpp writes ``mamba2`` files. Not the native runner's, nor the GPU runner's yet."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import Family
from runlm.models.families.granitemoehybrid import mamba2_fields, mamba2_gguf_fields

# Mamba2Config's names for the shape's parts (runlm.models.families.granitemoehybrid.MAMBA_KEYS)
KEYS = {"heads": "num_heads", "head_dim": "head_dim", "state": "state_size", "groups": "n_groups",
        "conv": "conv_kernel", "expand": "expand", "conv_bias": "use_conv_bias", "proj_bias": "use_bias"}


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return {**mamba2_fields(cfg, list(range(fields["num_layers"])), KEYS),
            "rms_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5))}


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return {**mamba2_gguf_fields(get, fields), "recurrent_layers": list(range(fields["num_layers"]))}


FAMILY = Family("mamba2", torch_model="runlm.models.nemotron_h:MixerBlockForCausalLM", mixer_blocks=True,
                hf_fields=_hf_fields, gguf_fields=_gguf_fields,
                gguf_tensor_names={"attn_norm": "norm", "ssm_in": "mixer.in_proj", "ssm_out": "mixer.out_proj",
                                   "ssm_conv1d": "mixer.conv1d", "ssm_norm": "mixer.norm", "ssm_a": "mixer.A_log",
                                   "ssm_d": "mixer.D", "ssm_dt.bias": "mixer.dt_bias"},
                hf_tensor_names={"backbone.embeddings.": "model.embed_tokens.", "backbone.norm_f.": "model.norm.",
                                 "backbone.layers.": "model.layers."},
                native=False, native_safetensors=False)
