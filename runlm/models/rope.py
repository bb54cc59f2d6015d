"""Rotary position embeddings with the scaling variants Llama-family configs use.

Each variant reproduces transformers' ``ROPE_INIT_FUNCTIONS`` so logits match HF to fp32
rounding. Rotation is the "rotate half" (NeoX) layout, or, for GGUF Q/K weights kept as stored in the
interleaved layout (Llama-arch files), rotation of adjacent pairs: q and k then carry the same
per-head permutation of their features, which leaves every attention score unchanged.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runlm.models.attention import get_forward_context


def _default(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, p: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, p: Mapping[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = p.get("factor") or max_pos / p["original_max_position_embeddings"]
    orig = p.get("original_max_position_embeddings", max_pos)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attn


def _longrope(dim: int, base: float, p: Mapping[str, Any], factors: str) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency factors, short ones up to original_max_position_embeddings, long beyond."""
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or 1.0
    attn = p.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(p[factors], dtype=torch.float32)
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attn


LONGROPE = ("longrope", "su")


def rope_kind(scaling: Mapping[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def inverse_frequencies(head_dim: int, base: float, scaling: Mapping[str, Any] | None,
                        max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) for a RoPE config (LongRoPE: the short factors'); raises ValueError for an
    unknown type."""
    kind = rope_kind(scaling)
    inv = _default(head_dim, base)
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, base, scaling, max_position)
    if kind in LONGROPE:
        return _longrope(head_dim, base, scaling, "short_factor")
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn, longrope)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position.

    ``rotary_dim`` < head_dim rotates only the first rotary_dim features of each head (partial rotary).
    LongRoPE keeps a second table for the long factors, used for every token of a sequence whose context
    is longer than original_max_position_embeddings (transformers' rule: the length decides, per sequence)."""

    def __init__(self, head_dim: int, base: float, scaling: Mapping[str, Any] | None, max_position: int,
                 freq_factors: torch.Tensor | None = None, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim or head_dim
        inv, attn = inverse_frequencies(self.rotary_dim, base, scaling, max_position)
        if freq_factors is not None:  # GGUF llama3 models carry their scaling as a rope_freqs tensor
            inv = inv / freq_factors.float()
        self.inv_freq = inv
        self.attention_scaling = attn
        self.long: RotaryEmbedding | None = None
        self.long_after = 0
        if rope_kind(scaling) in LONGROPE:
            assert scaling is not None
            self.long = RotaryEmbedding(self.rotary_dim, base, None, max_position)
            self.long.inv_freq, self.long.attention_scaling = _longrope(self.rotary_dim, base, scaling, "long_factor")
            self.long._build(max_position)
            self.long_after = int(scaling["original_max_position_embeddings"])
        self.interleaved = False
        self._build(max_position)

    @property
    def fusable(self) -> bool:
        """Whether the fused kernels' one whole-head table describes this rotation."""
        return self.long is None and self.rotary_dim == self.head_dim

    def use_interleaved_pairs(self) -> None:
        """Rotate features (2i, 2i+1) together, as llama.cpp does for its "normal" RoPE layout."""
        self.interleaved = True
        self._build(self.cos.shape[0])

    def _build(self, length: int) -> None:
        freqs = torch.arange(length, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos() * self.attention_scaling
        self.sin = emb.sin() * self.attention_scaling

    def ensure_positions(self, need: int) -> None:
        """Grow the tables (doubling) to cover positions 0..need-1."""
        if need > self.cos.shape[0]:
            self._build(max(need, 2 * self.cos.shape[0]))

    def _tables(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        self.ensure_positions(int(positions.max()) + 1 if positions.numel() else 0)
        if self.cos.device != device:
            self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self.cos[positions], self.sin[positions]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D], positions: [T]."""
        cos, sin = self._tables(positions, q.device)
        if self.long is not None:
            long = _long_context_rows(self.long_after).to(q.device)
            if bool(long.any()):
                long_cos, long_sin = self.long._tables(positions, q.device)
                cos, sin = torch.where(long[:, None], long_cos, cos), torch.where(long[:, None], long_sin, sin)
        cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)
        rotate = _rotate_pairs if self.interleaved else _rotate_half
        r = self.rotary_dim
        if r == q.shape[-1]:
            return rotate(q, cos, sin), rotate(k, cos, sin)
        return (torch.cat((rotate(q[..., :r], cos, sin), q[..., r:]), dim=-1),
                torch.cat((rotate(k[..., :r], cos, sin), k[..., r:]), dim=-1))


def _long_context_rows(threshold: int) -> torch.Tensor:
    """[T] bool: whether each token of the step belongs to a sequence whose context exceeds ``threshold``."""
    ctx = get_forward_context()
    longer = torch.tensor([n > threshold for n in ctx.context_lens])
    return longer.repeat_interleave(torch.tensor(ctx.query_lens))


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos + rotated * sin
