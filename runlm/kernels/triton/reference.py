"""Torch references for the paged kernels: plain loops, the definition the Triton kernels are tested against and
the backend's fallback where Triton does not run (a CPU without TRITON_INTERPRET).

The per-sequence attention is the same arithmetic as runlm.models.attention's loop (gather the context's K/V,
SDPA with the same mask, or the softcapped math), so on the CPU the GPU runner's tokens match the torch runner's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v [T, KVH, D] into the caches [num_blocks, block_size, KVH, D] at slots ``slot_mapping`` [T]; a slot
    below 0 (a padding row) writes nothing."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    rows = k_cache.shape[0] * k_cache.shape[1]
    for x, cache in ((k, k_cache), (v, v_cache)):
        values = x[keep].to(cache.dtype)  # (an fp8 cache: torch's cast saturates at e4m3's +-448)
        if cache.dtype == torch.float8_e4m3fn:  # (torch's CPU index_copy_ takes its bytes, not its fp8 values)
            cache, values = cache.view(torch.uint8), values.view(torch.uint8)
        cache.view(rows, *cache.shape[2:]).index_copy_(0, slots, values)


def context_slots(block_table_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """The cache slots of positions 0..seq_len-1 of one sequence (a released block's positions get slot 0: they
    are outside every window that reads them)."""
    pos = torch.arange(seq_len, device=block_table_row.device)
    blocks = block_table_row[pos // block_size].long().clamp(min=0)
    return blocks * block_size + pos % block_size


def causal_mask(q_len: int, kv_len: int, window: int | None, device: torch.device, chunk: int | None = None
                ) -> torch.Tensor | None:
    """The causal mask (with a sliding window; with ``chunk``, within each query's chunk of that many positions:
    Llama 4's chunked local attention) for the last q_len of kv_len positions: query i sits at kv_len - q_len + i;
    None where SDPA needs none. runlm.models.attention adds images' spans to it."""
    if q_len == 1 and (window is None or kv_len <= window) and (chunk is None or kv_len <= chunk):
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    if chunk is not None:
        allowed &= k_pos >= q_pos // chunk * chunk
    return allowed


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                       softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention with its scores written out: passed through softcap * tanh(s / softcap) (Gemma 2), and/or with one
    more logit per head in the softmax's denominator that attends to nothing (gpt-oss's sinks).
    q [H, Tq, D]; k, v [KVH, Tk, D]; sinks [H]."""
    repeat = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)
    scores = (q @ k.transpose(1, 2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return probs.to(q.dtype) @ v


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
               softcap: float | None, sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """One sequence: q [Tq, H, D] (the last Tq of the Tk positions); k, v [Tk, KVH, D]. Returns [Tq, H, D]."""
    mask = causal_mask(q.shape[0], k.shape[0], window, q.device, chunk)
    qs, ks, vs = q.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
    if softcap or sinks is not None:
        o = explicit_attention(qs, ks, vs, mask, scale, softcap, sinks)
    else:
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int | None = None,
                        softcap: float | None = None, num_seqs: int | None = None,
                        out: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                        chunk: int | None = None) -> torch.Tensor:
    """Same contract as runlm.kernels.triton.attention.paged_attention, one sequence at a time (reads the
    metadata on the host)."""
    out = torch.empty_like(q) if out is None else out
    block_size = k_cache.shape[1]
    rows = k_cache.shape[0] * block_size
    k_flat, v_flat = k_cache.view(rows, *k_cache.shape[2:]), v_cache.view(rows, *v_cache.shape[2:])
    n = len(seq_lens) if num_seqs is None else num_seqs
    starts, lens = cu_seqlens_q[:n + 1].tolist(), seq_lens[:n].tolist()
    for i in range(n):
        start, end, seq_len = starts[i], starts[i + 1], lens[i]
        if end == start:
            continue
        slots = context_slots(block_table[i], seq_len, block_size)
        out[start:end] = attend_one(q[start:end], k_flat[slots], v_flat[slots], scale, window, softcap, sinks,
                                    chunk)
    return out
