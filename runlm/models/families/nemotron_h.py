"""Nemotron-H (Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano): each layer one norm and one mixer
(runlm.models.nemotron_h) -- Mamba2 ("M"), attention without RoPE ("*"), a ReLU² MLP ("-") or experts ("E":
DeepSeek-V3's router, sigmoid scores with a choice bias and groups, ReLU² experts and a shared one) -- as its
``hybrid_override_pattern`` (or ``layers_block_type``) lays them out. llama.cpp writes ``nemotron_h`` files (and
``nemotron_h_moe`` with experts). Experts over a latent projection (``moe_latent_size``) are refused. The Mamba2
layers keep a recurrent state per sequence: no prefix caching, no speculation. Not the native runner's, nor the GPU
runner's yet."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.formats import ModelFormatError
from runlm.models.families import Family
from runlm.models.families.granitemoehybrid import RECURRENT_TYPES, mamba2_fields, mamba2_gguf_fields

# hybrid_override_pattern's letters -> layers_block_type's names
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# NemotronHConfig's names for the Mamba2 shape's parts (runlm.models.families.granitemoehybrid.MAMBA_KEYS)
_KEYS = {"heads": "mamba_num_heads", "head_dim": "mamba_head_dim", "state": "ssm_state_size", "groups": "n_groups",
         "conv": "conv_kernel", "expand": "expand", "conv_bias": "use_conv_bias", "proj_bias": "mamba_proj_bias"}


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("moe_latent_size"):
        raise ModelFormatError("Nemotron-H's experts over a latent projection (moe_latent_size) are not supported")
    pattern = cfg.get("hybrid_override_pattern")
    types = [_PATTERN[c] for c in pattern] if isinstance(pattern, str) else list(cfg["layers_block_type"])
    layers = len(types)
    out: dict[str, Any] = dict(
        **mamba2_fields(cfg, [i for i, t in enumerate(types) if t in RECURRENT_TYPES], _KEYS),
        num_layers=layers, mlp_layers=[i for i, t in enumerate(types) if t in ("mlp", "moe")])
    out.update(
        # (transformers' Nemotron-H clamps each step's dt at time_step_min, not at its time_step_limit)
        ssm_dt_limit=(float(cfg.get("time_step_min", 0.001)), float("inf")),
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), nope_layers=list(range(layers)),
        hidden_act=str(cfg.get("mlp_hidden_act") or "relu2"))
    moe = [i for i, t in enumerate(types) if t == "moe"]
    if moe:
        out.update(dense_layers=[i for i in range(layers) if i not in moe],
                   shared_expert_intermediate_size=int(cfg.get("n_shared_experts") or 1)
                   * int(cfg["moe_shared_expert_intermediate_size"]))
    else:
        out.update(num_experts=0, num_experts_per_tok=0, dense_layers=[], shared_expert_intermediate_size=0)
    return out


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """llama.cpp's layout: per layer, KV heads (attention) or a feed-forward length (an MLP or experts), else Mamba2."""
    out = mamba2_gguf_fields(get, fields)
    ffn = get("feed_forward_length")
    ffn = ffn if isinstance(ffn, list) else [ffn] * fields["num_layers"]
    out["mlp_layers"] = [i for i, n in enumerate(ffn) if n]
    out["recurrent_layers"] = [i for i in out["recurrent_layers"] if not ffn[i]]
    out["nope_layers"] = list(range(fields["num_layers"]))
    out["ssm_dt_limit"] = (0.001, float("inf"))  # (transformers' time_step_min, which the file does not carry)
    if fields["num_experts"]:  # (its experts' layers: those with a router, the rest of the MLP layers dense)
        out["intermediate_size"] = int(get("expert_feed_forward_length") or max(ffn))
    return out


_MIXER = {"attn_norm": "norm", "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj",
          "attn_output": "mixer.o_proj", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",
          "ssm_in": "mixer.in_proj", "ssm_out": "mixer.out_proj", "ssm_conv1d": "mixer.conv1d",
          "ssm_norm": "mixer.norm",
          "ssm_a": "mixer.A_log", "ssm_d": "mixer.D", "ssm_dt.bias": "mixer.dt_bias", "ffn_gate_inp": "mixer.gate",
          "exp_probs_b": "mixer.score_bias", "ffn_up_exps": "mixer.experts.{e}.up_proj",
          "ffn_down_exps": "mixer.experts.{e}.down_proj", "ffn_up_shexp": "mixer.shared_expert.up_proj",
          "ffn_down_shexp": "mixer.shared_expert.down_proj"}

FAMILY = Family("nemotron_h", torch_model="runlm.models.nemotron_h:MixerBlockForCausalLM", mixer_blocks=True,
                hidden_act="relu2", gated_mlp=False, norm_topk_prob=True, gguf_norm_topk_prob=True,
                moe_gating="sigmoid", moe_score_bias=True, layer_norm=False, hf_fields=_hf_fields,
                gguf_fields=_gguf_fields, gguf_tensor_names=_MIXER,
                hf_tensor_names={"backbone.embeddings.": "model.embed_tokens.", "backbone.norm_f.": "model.norm.",
                                 "backbone.layers.": "model.layers.", ".mixer.shared_experts.": ".mixer.shared_expert.",
                                 ".mixer.gate.e_score_correction_bias": ".mixer.score_bias.bias"},
                native=False, native_safetensors=False)
