"""LFM2 (Liquid AI): gated short convolutions (runlm.models.short_conv) on most layers, attention with per-head q/k
norms on the layers ``layer_types`` (or ``full_attn_idxs``) names, a SwiGLU MLP (``feed_forward`` w1/w3/w2, its width
adjusted as the config says) after each; the final norm is called ``embedding_norm``. The convolutions keep a state per
sequence: no prefix caching, no speculation. llama.cpp writes ``lfm2`` files. Not the native runner's, nor the GPU
runner's yet."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from runlm.models.families import Family
from runlm.models.families.granitemoehybrid import kv_less_layers


def _hf_fields(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    layers = fields["num_layers"]
    types = cfg.get("layer_types") or ["full_attention" if i in (cfg.get("full_attn_idxs") or range(layers))
                                       else "conv" for i in range(layers)]
    size = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim", True):  # (transformers' Lfm2MLP)
        size = int(2 * size / 3)
        if cfg.get("block_ffn_dim_multiplier") is not None:
            multiple = int(cfg.get("block_multiple_of") or 256)
            size = int(float(cfg["block_ffn_dim_multiplier"]) * size)
            size = multiple * ((size + multiple - 1) // multiple)
    return dict(recurrent_layers=[i for i, t in enumerate(types) if t == "conv"], recurrent_kind="short_conv",
                ssm_conv_kernel=int(cfg.get("conv_L_cache") or 3), ssm_conv_bias=bool(cfg.get("conv_bias", False)),
                intermediate_size=size, rms_norm_eps=float(cfg.get("norm_eps", 1e-5)),
                tie_word_embeddings=bool(cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))))


def _gguf_fields(get: Callable[..., Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """llama.cpp's: per layer KV heads (0: a convolution), ``shortconv.l_cache`` taps."""
    return dict(recurrent_layers=kv_less_layers(get, fields["num_layers"]), recurrent_kind="short_conv",
                ssm_conv_kernel=int(get("shortconv.l_cache") or 3), ssm_conv_bias=False)


FAMILY = Family("lfm2", torch_model="runlm.models.hybrid:HybridForCausalLM", qk_norm=True, hf_fields=_hf_fields,
                gguf_fields=_gguf_fields,
                gguf_tensor_names={"shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
                                   "shortconv.conv": "conv.conv"}, gguf_global_names={"token_embd_norm": "model.norm"},
                hf_tensor_names={".feed_forward.w1.": ".mlp.gate_proj.", ".feed_forward.w3.": ".mlp.up_proj.",
                                 ".feed_forward.w2.": ".mlp.down_proj.", ".self_attn.out_proj.": ".self_attn.o_proj.",
                                 ".self_attn.q_layernorm.": ".self_attn.q_norm.",
                                 ".self_attn.k_layernorm.": ".self_attn.k_norm.",
                                 ".operator_norm.": ".input_layernorm.", ".ffn_norm.": ".post_attention_layernorm.",
                                 "model.embedding_norm.": "model.norm."},
                native=False, native_safetensors=False)
