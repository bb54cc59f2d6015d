"""Causal attention over the paged KV cache (AVX2 + FMA C++ kernel, compiled on first use).

``paged_attention`` serves a whole step's query rows in one call per layer, reading K/V rows
through each sequence's slot list; a row's result is bitwise the same whatever else is in
the step or how its prompt was chunked (see csrc/attention.cpp). Returns None for inputs it
does not cover (not fp32 on CPU, no kernel): the caller then uses torch's SDPA.
"""
from __future__ import annotations

import torch

from runlm.kernels.build import LazyKernel

_kernel = LazyKernel("runlm_attention", "attention.cpp")


def available() -> bool:
    """True once compiled and loaded on an AVX2+FMA CPU. Never raises; cached."""
    return _kernel.available()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    query_lens: list[int], context_lens: list[int], scale: float,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor | None:
    """q [T, H, D]; caches [S, KVH, D]; slots: every sequence's context slots, concatenated; softcap: scores
    pass through softcap * tanh(s / softcap) first. -> [T, H, D], or None when the kernel does not apply."""
    if q.device.type != "cpu" or not available():
        return None
    return _kernel.loaded().paged_attention(q, k_cache, v_cache, slots, query_lens, context_lens, scale,
                                            window or 0, softcap or 0.0)
