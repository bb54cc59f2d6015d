"""Granite 4 (GraniteMoeHybrid, the ``-h`` models): Granite 3's multipliers (runlm.models.families.granite) around
layers that are Mamba2 mixers (``layer_types`` "mamba"/"linear_attention") or attention (no RoPE unless
``position_embedding_type`` says "rope"), each followed by experts beside an always-on MLP (``shared_mlp``) or by
that MLP alone (no experts). The mixers keep a recurrent state per sequence (runlm.models.mamba2), so prefixes are
not cached and drafts are not verified. Not the native runner's, nor the GPU runner's yet."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import Family
from runlm.models.families.granite import FAMILY as GRANITE

RECURRENT_TYPES = ("mamba", "linear_attention")  # transformers' current name and the checkpoints' older one


# a Mamba2 shape's parts -> the HF config's keys for them: Granite 4's, Bamba's and Falcon-H1's (the families
# named otherwise pass their own)
MAMBA_KEYS = {"heads": "mamba_n_heads", "head_dim": "mamba_d_head", "state": "mamba_d_state",
              "groups": "mamba_n_groups", "conv": "mamba_d_conv", "expand": "mamba_expand",
              "conv_bias": "mamba_conv_bias", "proj_bias": "mamba_proj_bias"}


def mamba2_fields(cfg: Mapping[str, Any], recurrent: list[int], keys: Mapping[str, str] = MAMBA_KEYS) -> dict[str, Any]:
    """A HF config's Mamba2 shape, read under ``keys``; the head width, where the config says "auto" or nothing,
    the expanded hidden width over the heads."""
    heads = int(cfg[keys["heads"]])
    head_dim = cfg.get(keys["head_dim"])
    if head_dim in (None, "auto"):
        head_dim = int(cfg.get(keys["expand"]) or 2) * int(cfg["hidden_size"]) // heads
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    return dict(recurrent_layers=recurrent, ssm_heads=heads, ssm_head_dim=int(head_dim),
                ssm_state=int(cfg[keys["state"]]), ssm_groups=int(cfg.get(keys["groups"]) or 1),
                ssm_conv_kernel=int(cfg.get(keys["conv"]) or 4), ssm_conv_bias=bool(cfg.get(keys["conv_bias"], True)),
                ssm_proj_bias=bool(cfg.get(keys["proj_bias"], False)),
                ssm_dt_limit=(_float(limit[0]), _float(limit[1])))


def _float(value: Any) -> float:
    """A JSON number, or transformers' spelling of one JSON cannot hold ({"__float__": "Infinity"})."""
    return float(value["__float__"] if isinstance(value, Mapping) else value)


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    assert GRANITE.hf_fields is not None
    out = GRANITE.hf_fields(cfg, fields)
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * fields["num_layers"]
    out.update(mamba2_fields(cfg, [i for i, t in enumerate(types) if t in RECURRENT_TYPES]))
    shared = int(cfg.get("shared_intermediate_size") or 0)
    if fields["num_experts"]:
        out["shared_expert_intermediate_size"] = shared
        out["moe_intermediate_size"] = int(cfg["intermediate_size"])
    else:
        out["intermediate_size"] = shared
    if cfg.get("position_embedding_type") != "rope":
        out["nope_layers"] = list(range(fields["num_layers"]))
    return out


def mamba2_gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """A GGUF file's Mamba2 shape (llama.cpp's ``ssm.*`` keys; its ``time_step_rank`` is the head count) and which
    layers are recurrent (kv_less_layers)."""
    heads = int(get("ssm.time_step_rank"))
    return dict(recurrent_layers=kv_less_layers(get, fields["num_layers"]), ssm_heads=heads,
                ssm_head_dim=int(get("ssm.inner_size")) // heads,
                ssm_state=int(get("ssm.state_size")), ssm_groups=int(get("ssm.group_count") or 1),
                ssm_conv_kernel=int(get("ssm.conv_kernel")))


def kv_less_layers(get: Callable[..., Any], layers: int) -> list[int]:
    """The layers a hybrid's GGUF file gives no KV heads (its per-layer ``head_count_kv`` list; none without one)."""
    kv = get("attention.head_count_kv")
    return [i for i in range(layers) if not kv[i]] if isinstance(kv, list) else []


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    assert GRANITE.gguf_fields is not None
    out = {**GRANITE.gguf_fields(get, fields), **mamba2_gguf_fields(get, fields)}
    if not get("rope.scaling.finetuned", True):  # (llama.cpp's mark of a hybrid without RoPE)
        out["nope_layers"] = list(range(fields["num_layers"]))
    return out


FAMILY = Family("granitemoehybrid", torch_model="runlm.models.granite:GraniteHybridForCausalLM",
                norm_topk_prob=True, gguf_norm_topk_prob=True, hf_fields=_hf_fields, gguf_fields=_gguf_fields,
                native=False, native_safetensors=False)
