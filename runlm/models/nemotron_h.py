"""Decoders whose every layer is one norm and one mixer, as Nemotron-H and Mamba2 build them:

    x = x + mixer(norm(x))

the mixer a Mamba2 mixer (runlm.models.mamba2: ModelConfig.recurrent_layers), an MLP or a mixture of experts alone
(ModelConfig.mlp_layers; Nemotron-H's are ungated, ReLU²), or attention (the rest; Nemotron-H's without RoPE).
Checkpoints name it ``mixer`` whatever it is; the layers run on torch."""
from __future__ import annotations

import torch
from torch import nn

from runlm.models.config import ModelConfig
from runlm.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm, UngatedMLP
from runlm.models.mamba2 import Mamba2Mixer
from runlm.models.moe import SparseMoeBlock
from runlm.models.rope import RotaryEmbedding


class MixerBlock(DecoderLayer):
    fusable = False

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        nn.Module.__init__(self)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer: nn.Module
        self.positional = layer not in cfg.mlp_layers  # (an MLP takes no positions)
        if layer in cfg.recurrent_layers:
            self.mixer = Mamba2Mixer(cfg, layer)
        elif layer in cfg.mlp_layers:
            self.mixer = SparseMoeBlock(cfg) if cfg.is_moe_layer(layer) else \
                MLP(cfg) if cfg.gated_mlp else UngatedMLP(cfg)
        else:
            self.mixer = Attention(cfg, layer, rope)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + (self.mixer(positions, h) if self.positional else self.mixer(h))


class MixerBlockModel(LlamaModel):
    layer_cls: type[DecoderLayer] = MixerBlock


class MixerBlockForCausalLM(LlamaForCausalLM):
    model_cls: type[LlamaModel] = MixerBlockModel
