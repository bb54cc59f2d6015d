"""LFM2's gated short convolution, a recurrent layer beside attention (runlm.models.hybrid):

    B, C, x = in_proj(h);  y = C * causal_conv1d(B * x);  out = out_proj(y)

the convolution depthwise over the hidden width with a few taps; its last taps - 1 inputs are each sequence's state
(runlm.models.mamba2.causal_conv keeps them as the Mamba2 mixer's)."""
from __future__ import annotations

import torch
from torch import nn

from runlm.models.config import ModelConfig
from runlm.models.linear import Linear
from runlm.models.mamba2 import Conv1d, Slots, by_sequence, causal_conv


class ShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.width = layer, cfg.hidden_size
        self.in_proj = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.ssm_conv_bias)
        self.conv = Conv1d(cfg.hidden_size, cfg.ssm_conv_kernel, cfg.ssm_conv_bias)
        self.out_proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.ssm_conv_bias)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, C, v = self.in_proj(x).chunk(3, dim=-1)
        y = C.float() * by_sequence(self.layer, [B * v], self.width, self._conv)
        return self.out_proj(y.to(x.dtype))

    def _conv(self, inputs: list[torch.Tensor], slots: Slots) -> torch.Tensor:
        return causal_conv(inputs[0], self.conv, slots)
