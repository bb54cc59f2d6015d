"""Measuring a model's numerics: next-token logits at every position of a text, and the KL divergence
between two such runs (fast mode against exact mode, or llama.cpp against exact mode).

Text is real English prose that every Python ships: the language reference's topic pages
(``pydoc_data.topics``), so the measurement needs no download and is the same everywhere.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from runlm.models.attention import ForwardContext, forward_context

if TYPE_CHECKING:
    from runlm.models.native import NativeModel


def english_text(min_chars: int = 40_000) -> str:
    """At least ``min_chars`` of English prose (Python's topic help pages, in a fixed order)."""
    from pydoc_data.topics import topics

    parts, size = [], 0
    for key in sorted(topics):
        parts.append(topics[key])
        size += len(topics[key])
        if size >= min_chars:
            break
    return "\n".join(parts)


def all_logits(model, ids: list[int], chunk: int = 512,
               mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] of a decoder, through a KV cache, in independent windows of
    ``chunk`` tokens (each window starts a fresh context, as llama.cpp's perplexity tool does).
    ``mm_embeds``: images' rows (positions, embeddings) written over the token embeddings, for a prompt that
    fits one window."""
    if mm_embeds is not None and len(ids) > chunk:
        raise ValueError("a prompt with images is measured in one window")
    cfg = model.config
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            window = ids[start:start + chunk]
            n = len(window)
            heads, k_dim, v_dim = cfg.kv_cache_shape
            caches = [(torch.empty(n, heads, k_dim), torch.empty(n, heads, v_dim)) for _ in range(cfg.num_layers)]
            slots = torch.arange(n)
            ctx = ForwardContext([n], [n], slots, [slots], caches, mm_embeds=mm_embeds)
            with forward_context(ctx):
                hidden = model(torch.tensor(window), torch.arange(n))
                out.append(model.compute_logits(hidden).float())
    return torch.cat(out)


def paged_logits(model, ids: list[int], cache_dtype: torch.dtype, chunk: int = 512,
                 block_size: int = 16) -> torch.Tensor:
    """``all_logits`` through the GPU runner's paged attention (runlm.kernels.triton.backend), its cache in
    ``cache_dtype`` (float8_e4m3fn: ``--kv-cache-dtype fp8``): each window prefilled in one step, so every query
    reads the keys and values as the cache holds them."""
    from runlm.kernels.triton.backend import PagedAttentionBackend

    cfg = model.config
    device = next(model.parameters()).device
    heads, k_dim, v_dim = cfg.kv_cache_shape
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            window = ids[start:start + chunk]
            n, blocks = len(window), -(-len(window) // block_size)
            backend = PagedAttentionBackend(cfg.num_layers, blocks, block_size, heads, k_dim, cache_dtype, device, 1,
                                            n, blocks, kv_layers=cfg.kv_layers, latent=v_dim == 0)
            backend.set_step(torch.arange(blocks, dtype=torch.int32).view(1, -1),
                             torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                             torch.arange(n), max_query_len=n)
            with forward_context(ForwardContext([n], [n], None, None, None, backend=backend)):
                hidden = model(torch.tensor(window, device=device), torch.arange(n, device=device))
                out.append(model.compute_logits(hidden).float().cpu())
    return torch.cat(out)


def native_logits(model: NativeModel, ids: list[int], chunk: int = 512, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """``all_logits`` of a model on the native runner (runlm.models.native.NativeModel): what fast mode serves;
    ``kv_cache_dtype`` as the engine's (``q8_0``: the 8-bit cache)."""
    import numpy as np

    from runlm.native.kv_cache import allocate

    cfg, decoder = model.config, model.decoder
    assert decoder is not None
    out = []
    for start in range(0, len(ids), chunk):
        window = np.asarray(ids[start:start + chunk], dtype=np.int64)
        n = len(window)
        decoder.set_kv_caches([allocate(kv_cache_dtype, n, cfg.num_kv_heads, cfg.head_dim)
                               for _ in range(cfg.num_layers)])
        slots, lens = np.arange(n, dtype=np.int64), np.array([n], dtype=np.int64)
        hidden = decoder.forward(window, slots, slots, lens, lens, slots, np.empty((n, cfg.hidden_size), np.float32))
        out.append(torch.from_numpy(model.compute_logits(hidden)))
    return torch.cat(out)


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(P_reference || P_other) of the next-token distributions, in nats (float64, a few
    rows at a time: a 4096 x 49152 pair at once took twice as long)."""
    total = 0.0
    for start in range(0, reference.shape[0], 8):
        ref = torch.log_softmax(reference[start:start + 8].double(), dim=-1)
        oth = torch.log_softmax(other[start:start + 8].double(), dim=-1)
        total += float((ref.exp() * (ref - oth)).sum())
    return total / reference.shape[0]
