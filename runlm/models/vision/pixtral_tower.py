"""The Pixtral tower, Mistral 3's patch merger and projector (torch): runlm.models.vision.pixtral configures them
and builds the processor."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runlm.formats import ModelFormatError
from runlm.models.vision.inputs import ImageFeature

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return self.o_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, h))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        if act not in _ACTIVATIONS:
            raise ModelFormatError(f"Pixtral hidden_act {act!r} is not supported")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.attention_norm = _RMSNorm(c["hidden_size"], 1e-5)
        self.attention = _Attention(c["hidden_size"], c["num_attention_heads"])
        self.ffn_norm = _RMSNorm(c["hidden_size"], 1e-5)
        self.feed_forward = _MLP(c["hidden_size"], c["intermediate_size"], c["hidden_act"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class _Transformer(nn.Module):
    def __init__(self, c: dict, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(c) for _ in range(layers))


class PixtralTower(nn.Module):
    """forward(pixels [B, C, H, W], one size for the batch) -> [B, (H/p) * (W/p), hidden]: the output of layer
    ``keep`` (hidden_states[keep]; the layers after it are not built). Names as transformers' PixtralVisionModel."""
    inv_freq: torch.Tensor

    def __init__(self, c: dict, keep: int) -> None:
        super().__init__()
        hidden, self.patch = c["hidden_size"], c["patch_size"]
        self.patch_conv = nn.Conv2d(c["num_channels"], hidden, self.patch, self.patch, bias=False)
        self.ln_pre = _RMSNorm(hidden, 1e-5)
        self.transformer = _Transformer(c, keep)
        head_dim = hidden // int(c["num_attention_heads"])  # transformers sets it so, whatever the config says
        inv = 1.0 / (float(c["rope_theta"]) ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", torch.cat([inv[0::2], inv[1::2]]), persistent=False)

    def rope(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [rows * cols, head_dim]: a patch's row on the first half of the frequencies, its column on
        the second (transformers' PixtralVisionRotaryEmbedding)."""
        hpos, wpos = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        pos = torch.stack([hpos.flatten(), wpos.flatten()], dim=-1).to(self.inv_freq.device)
        freqs = pos[..., None].float() * self.inv_freq  # [N, 2, head_dim / 2]
        quarter = freqs.shape[-1] // 2
        hw = torch.cat([freqs[:, 0, :quarter], freqs[:, 1, quarter:]], dim=-1)
        angles = torch.cat([hw, hw], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.patch_conv.weight
        x = self.patch_conv(pixels.to(w.dtype))  # [B, hidden, rows, cols]
        rows, cols = x.shape[-2:]
        x = self.ln_pre(x.flatten(2).transpose(1, 2))
        cos, sin = self.rope(rows, cols)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.transformer.layers:
            x = layer(x, cos, sin)
        return x


class _PatchMerger(nn.Module):
    def __init__(self, hidden: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(hidden * merge * merge, hidden, bias=False)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """x [rows * cols, hidden] -> [(rows / m) * (cols / m), hidden]: each m x m block's patches, concatenated
        channel-major (torch's unfold, as transformers does), through the merging layer."""
        d = x.shape[-1]
        grid = x.view(rows, cols, d).permute(2, 0, 1).unsqueeze(0)
        blocks = F.unfold(grid, kernel_size=self.merge, stride=self.merge)
        return self.merging_layer(blocks.view(d * self.merge ** 2, -1).t())


class _Projector(nn.Module):
    """Mistral 3's (norm, patch merger, MLP); LLaVA's (the MLP alone) with ``merge`` None."""

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int | None, eps: float, act: str,
                 bias: bool) -> None:
        super().__init__()
        self.norm = _RMSNorm(vision_hidden, eps) if merge is not None else None
        self.patch_merger = _PatchMerger(vision_hidden, merge) if merge is not None else None
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        if act not in _ACTIVATIONS:
            raise ModelFormatError(f"projector_hidden_act {act!r} is not supported")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        if self.norm is not None and self.patch_merger is not None:
            x = self.patch_merger(self.norm(x), rows, cols)
        return self.linear_2(self.act(self.linear_1(x)))


class PixtralVision(nn.Module):
    uses_mrope = False

    def __init__(self, vision_config: dict, feature_layer: int, merge: int | None, text_hidden: int,
                 norm_eps: float, act: str, bias: bool, processor: Any) -> None:
        """``feature_layer``: the index into hidden_states (0: after the pre-norm, i: after i layers) the projector
        reads; ``merge``: spatial_merge_size (Mistral 3), None for Pixtral-12B's plain MLP projector."""
        super().__init__()
        self.vision_tower = PixtralTower(vision_config, feature_layer)
        self.multi_modal_projector = _Projector(int(vision_config["hidden_size"]), text_hidden, merge, norm_eps, act,
                                                bias)
        self.patch = int(vision_config["patch_size"])
        self.processor = processor

    def encode(self, features: Sequence[ImageFeature]) -> list[torch.Tensor]:
        """One tower pass per image size (images of a size batched together: each attends only within itself)."""
        out: list[torch.Tensor | None] = [None] * len(features)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, f in enumerate(features):
            by_shape.setdefault(tuple(f.data["pixel_values"].shape), []).append(i)
        device = self.multi_modal_projector.linear_1.weight.device
        with torch.no_grad():
            for shape, idx in by_shape.items():
                pixels = torch.from_numpy(np.stack([features[i].data["pixel_values"] for i in idx])).to(device)
                hidden = self.vision_tower(pixels)
                rows, cols = shape[1] // self.patch, shape[2] // self.patch
                for i, h in zip(idx, hidden):
                    out[i] = self.multi_modal_projector(h, rows, cols).float()
        return [o for o in out if o is not None]

    @torch.no_grad()
    def load_hf(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = {f"vision_tower.{k}": v for k, v in self.vision_tower.named_parameters()}
        params.update({f"multi_modal_projector.{k}": v for k, v in self.multi_modal_projector.named_parameters()})
        keep = len(self.vision_tower.transformer.layers)
        seen = set()
        for name, tensor in weights:
            base = name.removeprefix("model.")
            if base.startswith("vision_tower.transformer.layers."):
                if int(base.split(".")[3]) >= keep:
                    continue  # a layer past the feature layer
            if base not in params:
                raise ModelFormatError(f"unexpected weight {name!r} in a Mistral 3 checkpoint")
            p = params[base]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ModelFormatError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            p.copy_(tensor.float())
            seen.add(base)
        missing = [k for k in params if k not in seen]
        if missing:
            raise ModelFormatError(f"the checkpoint lacks {len(missing)} vision weights, e.g. {missing[:3]}")
