"""The vision transformer SigLIP and CLIP share (Gemma 3, SmolVLM/Idefics3, LLaVA), with Hugging Face's
parameter names, so a checkpoint's vision weights load with their prefix removed.

SigLIP: patch embedding (a strided convolution) + learned positions, pre-norm layers with GELU-tanh MLPs,
a final layer norm. CLIP adds a class token and a norm before the layers, and uses quick-GELU.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


@dataclass(slots=True)
class ViTConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    clip: bool = False  # CLIP: a class token, a norm before the layers, no bias on the patch convolution

    @classmethod
    def from_hf(cls, cfg: dict, clip: bool = False) -> ViTConfig:
        return cls(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                   cfg["image_size"], cfg["patch_size"], cfg.get("num_channels", 3),
                   cfg.get("layer_norm_eps", 1e-5 if clip else 1e-6),
                   cfg.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh"), clip)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class _Embeddings(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, c.patch_size, bias=not c.clip)
        self.class_embedding = nn.Parameter(torch.zeros(c.hidden_size)) if c.clip else None
        self.position_embedding = nn.Embedding(c.num_patches + int(c.clip), c.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight[: x.shape[1]]


class _Attention(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, h))


class _MLP(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c.hidden_size, c.intermediate_size), nn.Linear(c.intermediate_size,
                                                                                       c.hidden_size)
        self.act = _ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = _Attention(c)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, c: ViTConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(c) for _ in range(num_layers))


class VisionTransformer(nn.Module):
    """forward(pixels [B, C, H, W]) -> [B, patches (+1 with CLIP's class token), hidden].

    ``feature_layer``: -1 returns the last layer, after SigLIP's final norm (the towers in Gemma 3 and SmolVLM);
    another index returns that layer's output without the final norm (LLaVA's ``vision_feature_layer``), and the
    layers after it are not built at all."""

    def __init__(self, c: ViTConfig, feature_layer: int = -1) -> None:
        super().__init__()
        self.config = c
        n = c.num_hidden_layers
        self.keep = n if feature_layer == -1 else (feature_layer % (n + 1))  # hidden_states[i]: after i layers
        self.embeddings = _Embeddings(c)
        self.pre_layrnorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps) if c.clip else None
        self.encoder = _Encoder(c, self.keep)
        # CLIP's final norm is for its pooled class token only: its last hidden state is the last layer's output
        last = feature_layer == -1 and not c.clip
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps) if last else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x) if self.post_layernorm is not None else x

    @torch.no_grad()
    def load_hf(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Weights named as in Hugging Face's SiglipVisionTransformer / CLIPVisionTransformer (prefix removed);
        those of layers past ``feature_layer`` and of a pooling head are skipped."""
        params = dict(self.named_parameters())
        seen = set()
        for name, tensor in weights:
            if name not in params:
                if name.startswith(("head.", "encoder.layers.", "post_layernorm.")):
                    continue  # the pooling head, layers past the feature layer, a final norm it does not use
                raise KeyError(f"unexpected vision weight {name!r}")
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise RuntimeError(f"vision weight {name}: shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            p.copy_(tensor.float())
            seen.add(name)
        missing = [n for n in params if n not in seen]
        if missing:
            raise KeyError(f"the checkpoint lacks {len(missing)} vision weights, e.g. {missing[:3]}")
