"""RoPE's inverse frequencies and cos/sin tables, in numpy (float32): what every runner rotates by.

Each scaling variant reproduces transformers' ``ROPE_INIT_FUNCTIONS``. The torch model
(runlm.models.rope) and the torch-free native runner (runlm.native) both take their tables from
here, so the two paths rotate by the same floats.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

LONGROPE = ("longrope", "su")


def _exponents(dim: int) -> np.ndarray:
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def _default(dim: int, base: float) -> np.ndarray:
    return np.float32(1.0) / (np.float32(base) ** _exponents(dim))


def _llama3(inv_freq: np.ndarray, p: Mapping[str, Any]) -> np.ndarray:
    factor, low, high = p["factor"], p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(dim: int, base: float, p: Mapping[str, Any], max_pos: int) -> tuple[np.ndarray, float]:
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
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(lo)) / np.float32(hi - lo), 0, 1)
    pos_freqs = np.float32(base) ** _exponents(dim)
    extrapolation = 1 - ramp
    inv = (np.float32(1.0) / (np.float32(factor) * pos_freqs)) * (1 - extrapolation) \
        + (np.float32(1.0) / pos_freqs) * extrapolation
    return inv.astype(np.float32), attn


def longrope(dim: int, base: float, p: Mapping[str, Any], factors: str) -> tuple[np.ndarray, float]:
    """Phi-3's LongRoPE: per-frequency factors, short ones up to original_max_position_embeddings, long beyond."""
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or 1.0
    attn = p.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = np.asarray(p[factors], dtype=np.float32)
    return np.float32(1.0) / (ext * np.float32(base) ** _exponents(dim)), attn


def rope_kind(scaling: Mapping[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def inverse_frequencies(head_dim: int, base: float, scaling: Mapping[str, Any] | None,
                        max_position: int) -> tuple[np.ndarray, float]:
    """(inv_freq, attention_scaling) for a RoPE config (LongRoPE: the short factors'); raises ValueError for an
    unknown type."""
    kind = rope_kind(scaling)
    inv = _default(head_dim, base)
    if kind == "default":
        return inv, 1.0
    assert scaling is not None
    if kind == "linear":
        return inv / np.float32(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, base, scaling, max_position)
    if kind in LONGROPE:
        return longrope(head_dim, base, scaling, "short_factor")
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn, longrope)")


def rope_tables(inv_freq: np.ndarray, attention_scaling: float, length: int,
                interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [length, 2 * len(inv_freq)] float32, for positions 0..length-1: each frequency's column
    twice, side by side (rotate-half) or as adjacent pairs (interleaved)."""
    freqs = np.arange(length, dtype=np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    emb = np.repeat(freqs, 2, axis=-1) if interleaved else np.concatenate((freqs, freqs), axis=-1)
    scale = np.float32(attention_scaling)
    return np.ascontiguousarray(np.cos(emb) * scale), np.ascontiguousarray(np.sin(emb) * scale)
