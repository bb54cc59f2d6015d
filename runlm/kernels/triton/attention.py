"""Unified paged attention in Triton: one launch per layer for the whole step, prefill chunks and decodes mixed.

The step's new tokens of every sequence are packed into q [T, H, D]; sequence b owns rows
``cu_seqlens_q[b] .. cu_seqlens_q[b+1]`` and, after this step, ``seq_lens[b]`` tokens of context, so its query i
sits at position ``seq_lens[b] - q_len + i`` and sees positions up to and including its own (and, with a sliding
window w, only the last w of them). K/V live in a paged cache:

    k_cache, v_cache: [num_blocks, block_size, KVH, D]   (any strides; D contiguous)
    block_table:      [B, max_blocks] int32              (entry < 0: a block given back, never read)

That layout is vLLM's and the torch runner's own ``[slots, KVH, D]`` cache viewed in blocks: slot
``block * block_size + offset`` is a row of the flattened cache, so the KV store is a scatter by slot and a block
is one contiguous chunk of ``block_size * KVH * D`` elements.

The kernel (after vLLM's ``triton_unified_attention``, written anew): one program per (block of BLOCK_Q query
tokens of one sequence, KV head). Its BLOCK_M = BLOCK_Q * (H / KVH) rows are those tokens' query heads that share
the KV head (GQA: K/V are read once for the whole group), so even a 1-token decode fills a tensor-core tile. The
grid has ``T // BLOCK_Q + B`` programs along axis 0 -- an upper bound of the q blocks, known without reading the
lengths on the host, so a CUDA graph can capture the launch; a program finds its sequence by binary search over
``cu_seqlens_q`` and leaves if its block is past the sequence's queries. It walks the context in tiles of TILE
positions (each position's block looked up in the table), with an online softmax in fp32 and causal/window
masks; tiles wholly outside the window or after the block's last query are skipped. Split-KV (``num_segments``,
for decode steps of few sequences): a third grid axis splits each context's tiles into runs whose unnormalised
partials and softmax statistics a second small kernel merges (vLLM's 3D path). Softcap (Gemma 2) is
``softcap * tanh(s / softcap)`` on the scaled scores; a head's sink (gpt-oss) is one more logit in the softmax's
denominator, added after the walk (or in the merge). fp32 inputs use IEEE dots (no TF32) so fp32 matches the
reference to ~1e-6; bf16/fp16 multiply in their dtype with fp32 accumulation, P cast to V's dtype for P @ V
(under the interpreter bf16 is computed in fp32: its bf16 arithmetic is wrong, only loads/stores are checked).

Without a cache (the pooling runner: embedders and rerankers, runlm.kernels.triton.backend.VarlenAttention), the
step's own K/V are the "cache" in blocks of one position, and ``CAUSAL=False`` lets every query see its whole
sequence (BERT's encoder).

Padded launches: sequences past the real ones get ``cu_seqlens_q`` equal to the last real end (no queries); rows
past ``cu_seqlens_q[num_seqs]`` are not written.

Batch invariance: a row's arithmetic depends only on its own position and context (tiles sit at absolute
positions; tiles past a row's position add exact zeros), never on the other rows of the step -- except that
split-KV sums a decode row in another order than the one-pass kernel (last bits differ).

Candidates for issue 28, and why this one (bench/gpu_attention_bench.py measures all three on a GPU; none was lent
to the session that wrote this, so its figures are still to be taken):
- this Triton kernel: one launch per layer, block table on the device, mixed prefill/decode, GQA, window,
  softcap, nothing read on the host (CUDA-graph capturable); needs only torch + Triton, which the GPU machines
  hold, and runs in CI under TRITON_INTERPRET=1. vLLM serves with the same design (``triton_attn``) wherever
  FlashAttention is absent. Chosen.
- torch flex_attention with a paged block mask: one call per layer too, but the mask maps every physical slot
  to its sequence and position, so create_block_mask must run every step from the block tables (host-driven,
  sized by the whole cache, not the batch); the kernel comes from torch.compile per shape family (slow start,
  recompiles as batch shapes change, hard to capture per padded batch size); its sparsity is 128-position blocks
  over 16-token pages from many sequences. Kept as the bench's baseline.
- SDPA per sequence (today's torch path): a Python loop with a gather and a launch per sequence per layer --
  what issue 28 profiled (75% of host time); the bench's floor.
- FlashInfer / flash-attn: not installable on the GPU machines (no package index; a 62 MB wheel plus CUTLASS DSL,
  or no wheel and a long source build), so they cannot be proven there; they could sit behind the same
  AttentionBackend where a user has them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runlm.kernels.triton.fp8 import e4m3_value
from runlm.kernels.triton.kv_store import is_fp8, kernel_view


@triton.jit
def _tanh(x):
    # tanh from exp: portable across Triton versions and the interpreter; exact limits at +-inf
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit(do_not_specialize=["num_seqs"])
def _unified_attention_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr, sinks_ptr,
    scale, softcap, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    WINDOW: tl.constexpr, CHUNK: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, NUM_SEGMENTS: tl.constexpr, CAUSAL: tl.constexpr,
    FP8: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    # the sequence whose q blocks include this one: the last b with cu_seqlens_q[b] // BLOCK_Q + b <= q_block
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # the position of this sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    q_idx = local * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = first_pos + q_idx

    # the context this block's queries can see: [kv_lo, kv_hi)
    kv_hi = seq_len
    if CAUSAL:
        kv_hi = tl.minimum(first_pos + local * BLOCK_Q + BLOCK_Q, seq_len)
    kv_lo = 0
    if WINDOW > 0:
        kv_lo = tl.maximum(first_pos + local * BLOCK_Q - WINDOW + 1, 0)
    if CHUNK > 0:  # (nothing before the chunk of the block's first query)
        kv_lo = tl.maximum(kv_lo, (first_pos + local * BLOCK_Q) // CHUNK * CHUNK)
    tile_lo = kv_lo // TILE
    tile_hi = (kv_hi + TILE - 1) // TILE
    if NUM_SEGMENTS > 1:  # split-KV: this program takes one of NUM_SEGMENTS equal runs of those tiles
        segment = tl.program_id(2)
        per_segment = (tile_hi - tile_lo + NUM_SEGMENTS - 1) // NUM_SEGMENTS
        tile_lo = tile_lo + segment * per_segment
        tile_hi = tl.minimum(tile_lo + per_segment, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    offs = tl.arange(0, TILE)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    for t in range(tile_lo, tile_hi):
        pos = t * TILE + offs
        pos_ok = pos < kv_hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=-1)
        pos_ok = pos_ok & (block >= 0)
        block = tl.maximum(block, 0).to(tl.int64)
        within = pos % BLOCK_SIZE
        k = tl.load(k_cache_ptr + block[None, :] * stride_kb + within[None, :] * stride_ks + kv_head * stride_kh
                    + dims[:, None], mask=dim_ok[:, None] & pos_ok[None, :], other=0.0)  # [D, TILE]
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + within[:, None] * stride_vs + kv_head * stride_vh
                    + dims[None, :], mask=pos_ok[:, None] & dim_ok[None, :], other=0.0)  # [TILE, D]
        if FP8:  # (the cache's e4m3 bytes, decoded)
            k, v = e4m3_value(k), e4m3_value(v)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        allowed = pos_ok[None, :]
        if CAUSAL:
            allowed = allowed & (pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - WINDOW)
        if CHUNK > 0:
            allowed = allowed & (pos[None, :] >= (q_pos // CHUNK * CHUNK)[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at zero
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS > 1:  # the unnormalised partial and its softmax statistics, merged by _merge_segments_kernel
        part = (token * NUM_HEADS + head) * NUM_SEGMENTS + segment
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
    else:
        if USE_SINKS:  # the head's sink logit joins the softmax's denominator (and attends to nothing)
            sink = tl.load(sinks_ptr + head).to(tl.float32)
            m_all = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_all)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp(sink - m_all)
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["num_seqs"])
def _merge_segments_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, cu_seqlens_q_ptr, sinks_ptr, num_seqs, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(cu_seqlens_q_ptr + num_seqs):
        return  # a padding row: never written
    segments = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    part = (token * NUM_HEADS + head) * NUM_SEGMENTS + segments
    m = tl.load(part_m_ptr + part)
    big = tl.max(m, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        big = tl.maximum(big, sink)
    weight = tl.exp(m - tl.where(big == float("-inf"), 0.0, big))  # an empty segment weighs 0
    total = tl.sum(tl.load(part_l_ptr + part) * weight, 0)
    if USE_SINKS:
        total += tl.exp(sink - big)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=dim_ok[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


_INTERPRETED = type(_unified_attention_kernel).__name__ == "InterpretedFunction"


def launch_shape(num_heads: int, num_kv_heads: int, min_rows: int = 16) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows per program (a power of two, at least ``min_rows`` and 16 for tensor cores) and the
    query tokens they hold (BLOCK_M // group; rows past BLOCK_Q * group are idle)."""
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(min_rows), triton.next_power_of_2(group))
    return block_m, block_m // group


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int | None = None,
                    softcap: float | None = None, num_seqs: int | None = None, out: torch.Tensor | None = None,
                    tile: int = 32, num_segments: int = 1, block_rows: int = 16, sinks: torch.Tensor | None = None,
                    chunk: int | None = None, causal: bool = True) -> torch.Tensor:
    """q [T, H, D] (any row/head strides, D contiguous); caches [num_blocks, block_size, KVH, D]; block_table
    [>= B, max_blocks] int32; cu_seqlens_q [>= B + 1] int32; seq_lens [>= B] int32, all on q's device. ``num_seqs``
    (B, default len(seq_lens)) is a host int so nothing is read back. ``num_segments`` > 1 (a power of two) splits
    each sequence's context into that many runs done by separate programs, then merges them (a second launch):
    for decode steps of few sequences, where one program per (sequence, KV head) leaves the GPU idle.
    ``block_rows``: query rows (tokens x heads of a group) per program; more (64) reads K/V fewer times in long
    prefills, 16 wastes least on decodes. ``sinks`` [H]: each head's attention-sink logit (gpt-oss), one more term
    of the softmax's denominator; ``chunk``: a query sees only its own chunk of that many positions (Llama 4);
    ``causal=False``: every query sees its sequence's whole context (an encoder: BERT). Returns out [T, H, D] in q's
    dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_attention needs a contiguous last (head_dim) dimension")
    out = torch.empty_like(q) if out is None else out
    n = seq_lens.shape[0] if num_seqs is None else num_seqs
    if num_tokens == 0 or n == 0:
        return out
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)} for {num_heads} query heads")
    block_m, block_q = launch_shape(num_heads, num_kv_heads, block_rows)
    fp8 = is_fp8(k_cache)  # (--kv-cache-dtype fp8: the kernel reads its bytes)
    k_cache, v_cache = kernel_view(k_cache), kernel_view(v_cache)
    # Triton's interpreter computes wrongly on bf16 operands (numpy has no bf16): there, compute in fp32
    upcast = _INTERPRETED and q.dtype == torch.bfloat16
    if num_segments > 1:
        if num_segments & (num_segments - 1):
            raise ValueError(f"num_segments must be a power of two, not {num_segments}")
        part_m = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_tokens, num_heads, num_segments, head_dim, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # never touched
    grid = (num_tokens // block_q + n, num_kv_heads, num_segments)
    _unified_attention_kernel[grid](
        out, part_acc, part_m, part_l, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens,
        out if sinks is None else sinks, float(scale), float(softcap or 0.0), n,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=k_cache.shape[1],
        TILE=tile, WINDOW=int(window or 0), CHUNK=int(chunk or 0), USE_SOFTCAP=bool(softcap),
        USE_SINKS=sinks is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast, NUM_SEGMENTS=num_segments, CAUSAL=causal, FP8=fp8,
    )
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out, part_acc, part_m, part_l, cu_seqlens_q, out if sinks is None else sinks, n, out.stride(0),
            out.stride(1), NUM_HEADS=num_heads, NUM_SEGMENTS=num_segments, HEAD_DIM=head_dim,
            HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)), USE_SINKS=sinks is not None,
        )
    return out
