"""Rotary position embeddings with the scaling variants Llama-family configs use.

The frequencies and tables come from runlm.models.rope_freqs (numpy; each variant reproduces
transformers' ``ROPE_INIT_FUNCTIONS``, so logits match HF to fp32 rounding). Rotation is the
"rotate half" (NeoX) layout, or, for GGUF Q/K weights kept as stored in the interleaved layout
(Llama-arch files), rotation of adjacent pairs: q and k then carry the same
per-head permutation of their features, which leaves every attention score unchanged.

M-RoPE (Qwen2.5-VL; a scaling with ``mrope_section``): positions are [3, T], one row per axis (time, height,
width), and the frequencies are split in three sections, each rotated by its own axis's position, as
transformers' ``apply_multimodal_rotary_pos_emb`` does; [T] positions rotate as plain RoPE (all axes equal).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runlm.kernels.triton import runs_on
from runlm.models.attention import get_forward_context
from runlm.models.rope_freqs import LONGROPE, inverse_frequencies, longrope, rope_kind, rope_tables


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position.

    ``rotary_dim`` < head_dim rotates only the first rotary_dim features of each head (partial rotary).
    LongRoPE keeps a second table for the long factors, used for every token of a sequence whose context
    is longer than original_max_position_embeddings (transformers' rule: the length decides, per sequence).
    A scaling with ``mrope_section`` (M-RoPE, rope_type "mrope" or another type's with the section) takes
    [3, T] positions as well as [T]."""

    def __init__(self, head_dim: int, base: float, scaling: Mapping[str, Any] | None, max_position: int,
                 freq_factors: torch.Tensor | None = None, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim or head_dim
        self.sync_free = False  # the tables cover every position, on the positions' device (the GPU runner's)
        self.on_host = False  # a layer offload's CPU layers' copy (runlm.models.offload): its tables stay on the host
        self.mrope_section: list[int] | None = None
        if scaling is not None and scaling.get("mrope_section"):
            self.mrope_section = [int(s) for s in scaling["mrope_section"]]
            if sum(self.mrope_section) != self.rotary_dim // 2:
                raise ValueError(f"mrope_section {self.mrope_section} does not cover the {self.rotary_dim // 2} "
                                 f"rotary frequencies")
            if rope_kind(scaling) == "mrope":  # the frequencies themselves are RoPE's default ones
                scaling = None
        inv_np, attn = inverse_frequencies(self.rotary_dim, base, scaling, max_position)
        inv = torch.from_numpy(inv_np)
        if freq_factors is not None:  # GGUF llama3 models carry their scaling as a rope_freqs tensor
            inv = inv / freq_factors.float()
        self.inv_freq = inv
        self.attention_scaling = attn
        self.long: RotaryEmbedding | None = None
        self.long_after = 0
        if rope_kind(scaling) in LONGROPE:
            assert scaling is not None
            self.long = RotaryEmbedding(self.rotary_dim, base, None, max_position)
            long_inv, self.long.attention_scaling = longrope(self.rotary_dim, base, scaling, "long_factor")
            self.long.inv_freq = torch.from_numpy(long_inv)
            self.long._build(max_position)
            self.long_after = int(scaling["original_max_position_embeddings"])
        self.interleaved = False
        self._build(max_position)
        self._mrope_axis: torch.Tensor | None = None  # [rotary_dim]: the axis (0, 1, 2) each table column takes

    @classmethod
    def identity(cls, head_dim: int, max_position: int) -> RotaryEmbedding:
        """cos 1 and sin 0 at every position: a layer without RoPE (NoPE) through the same code, fused or not."""
        rope = cls(head_dim, 10000.0, None, max_position)
        rope.inv_freq = torch.zeros_like(rope.inv_freq)
        rope._build(max_position)
        return rope

    @property
    def fusable(self) -> bool:
        """Whether the fused kernels' one whole-head table describes this rotation."""
        return self.long is None and self.rotary_dim == self.head_dim

    def use_interleaved_pairs(self) -> None:
        """Rotate features (2i, 2i+1) together, as llama.cpp does for its "normal" RoPE layout."""
        self.interleaved = True
        self._mrope_axis = None
        self._build(self.cos.shape[0])

    def _mrope_tables(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, rotary_dim] for [3, T] positions: frequency i of section s takes axis s's position."""
        assert self.mrope_section is not None
        if self._mrope_axis is None or self._mrope_axis.device != device:
            axis = torch.repeat_interleave(torch.arange(3), torch.tensor(self.mrope_section))
            axis = axis.repeat_interleave(2) if self.interleaved else axis.repeat(2)
            self._mrope_axis = axis.to(device)
        cos, sin = self._tables(positions, device)  # [3, T, D]
        index = self._mrope_axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
        return cos.gather(0, index)[0], sin.gather(0, index)[0]

    def _build(self, length: int) -> None:
        cos, sin = rope_tables(self.inv_freq.numpy(), self.attention_scaling, length, self.interleaved)
        self.cos, self.sin = torch.from_numpy(cos), torch.from_numpy(sin)

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
        """q: [T, H, D], k: [T, KVH, D], positions: [T] (or [3, T] with M-RoPE)."""
        if self.sync_free and positions.ndim == 1 and self.long is None:
            if runs_on(q.device.type):  # one launch: the tables' rows looked up on the device
                from runlm.kernels.triton.fused import rope

                return rope(q, k, positions, self.cos, self.sin, self.interleaved)
        if positions.ndim == 2:
            if self.mrope_section is None:
                raise ValueError("[3, T] positions need an M-RoPE model (a rope scaling with mrope_section)")
            cos, sin = self._mrope_tables(positions, q.device)
        else:
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
