"""Hybrid decoders: each layer's mixer is recurrent (ModelConfig.recurrent_layers: a Mamba2 mixer,
runlm.models.mamba2, or LFM2's gated short convolution, runlm.models.short_conv) or attention, then an MLP or
experts (with an always-on expert where the config has one), each branch scaled by ModelConfig.residual_scale
(Granite 4's multiplier; 1 elsewhere):

    x = x + mixer(norm(x)) * s;  x = x + mlp(norm(x)) * s

Granite 4 (runlm.models.granite) and Bamba name a Mamba2 mixer ``mamba``, LFM2 its convolution ``conv``, Qwen3-Next
its DeltaNet ``linear_attn`` (runlm.models.qwen3_next); the layers run on torch."""
from __future__ import annotations

import torch
from torch import nn

from runlm.models.config import ModelConfig
from runlm.models.gated_delta import GatedDeltaNet
from runlm.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm
from runlm.models.mamba2 import Mamba2Mixer
from runlm.models.moe import SparseMoeBlock
from runlm.models.rope import RotaryEmbedding
from runlm.models.short_conv import ShortConv

# ModelConfig.recurrent_kind -> the recurrent mixer's module name (as checkpoints name it) and class
_RECURRENT: dict[str, tuple[str, type[nn.Module]]] = {
    "mamba2": ("mamba", Mamba2Mixer), "short_conv": ("conv", ShortConv), "gated_delta": ("linear_attn", GatedDeltaNet)}


class HybridDecoderLayer(DecoderLayer):
    fusable = False

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        nn.Module.__init__(self)
        self.residual_scale = cfg.residual_scale
        self.self_attn: Attention | None = None  # type: ignore[assignment]
        if layer in cfg.recurrent_layers:
            name, cls = _RECURRENT[cfg.recurrent_kind]
            self.mixer_name = name
            setattr(self, name, cls(cfg, layer))
        else:
            self.mixer_name = "self_attn"
            self.self_attn = Attention(cfg, layer, rope)
        self.mlp: nn.Module = SparseMoeBlock(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        """The layer's recurrent mixer or attention."""
        mixer = getattr(self, self.mixer_name)
        assert isinstance(mixer, nn.Module)
        return mixer

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        mixer = self.mixer
        x = x + mixer(positions, self.input_layernorm(x)) * self.residual_scale
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_scale


class HybridModel(LlamaModel):
    layer_cls: type[DecoderLayer] = HybridDecoderLayer


class HybridForCausalLM(LlamaForCausalLM):
    model_cls: type[LlamaModel] = HybridModel
