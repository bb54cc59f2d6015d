"""Hybrid decoders: each layer's mixer is recurrent (ModelConfig.recurrent_layers: a Mamba2 mixer,
runlm.models.mamba2, or LFM2's gated short convolution, runlm.models.short_conv) or attention, then an MLP or
experts (with an always-on expert where the config has one), each branch scaled by ModelConfig.residual_scale
(Granite 4's multiplier; 1 elsewhere):

    x = x + mixer(norm(x)) * s;  x = x + mlp(norm(x)) * s

Granite 4 (runlm.models.granite) and Bamba name the mixer ``mamba`` as this module does, LFM2 ``conv``; the layers
run on torch."""
from __future__ import annotations

import torch
from torch import nn

from runlm.models.config import ModelConfig
from runlm.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm
from runlm.models.mamba2 import Mamba2Mixer
from runlm.models.moe import SparseMoeBlock
from runlm.models.rope import RotaryEmbedding
from runlm.models.short_conv import ShortConv


class HybridDecoderLayer(DecoderLayer):
    fusable = False

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        nn.Module.__init__(self)
        self.residual_scale = cfg.residual_scale
        self.mamba: Mamba2Mixer | None = None
        self.conv: ShortConv | None = None
        self.self_attn: Attention | None = None  # type: ignore[assignment]
        if layer in cfg.recurrent_layers and cfg.short_conv:
            self.conv = ShortConv(cfg, layer)
        elif layer in cfg.recurrent_layers:
            self.mamba = Mamba2Mixer(cfg, layer)
        else:
            self.self_attn = Attention(cfg, layer, rope)
        self.mlp: nn.Module = SparseMoeBlock(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        mixer = self.mamba or self.conv or self.self_attn
        assert mixer is not None
        x = x + mixer(positions, self.input_layernorm(x)) * self.residual_scale
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_scale


class HybridModel(LlamaModel):
    layer_cls: type[DecoderLayer] = HybridDecoderLayer


class HybridForCausalLM(LlamaForCausalLM):
    model_cls: type[LlamaModel] = HybridModel
