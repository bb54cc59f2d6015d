"""A mixture of experts in two grouped GEMMs: the GPU runner's routed experts, no host round trip, so a step with
experts can be captured in a CUDA graph (vLLM's ``fused_moe`` is the design learned from; the code is ours).

A step's T tokens each pick k experts: T x k (token, slot) pairs. ``align_pairs`` sorts the pairs by expert and pads
each expert's run to a multiple of BLOCK_M, on the device with fixed-size tensors (no ``.tolist()``, no sizes read
back): ``ids`` holds pair indices (padding = T x k) and ``block_expert`` each BLOCK_M rows' expert (-1 past the end).
The kernel then computes, for one block of rows and one tile of output columns, x[rows] @ W[expert]^T, reading the
expert's weights once for the whole block:

1. gate_up = x[pair // k] @ W_gate_up[e]^T       -> [T x k, 2I]
2. SiLU(gate) * up                               -> [T x k, I]   (runlm.kernels.triton.fused.silu_mul)
3. out = weight[pair] * (act[pair] @ W_down[e]^T) -> [T x k, H] in float32, summed over each token's k slots.

Weights are stacked per layer (runlm.models.gpu_moe): [E, N, K] in the model's dtype, or a GGUF's ggml blocks
[E, N, row_bytes] decoded in registers by runlm.kernels.triton.ggml_matmul's ``_weights``. The torch loop of
runlm.models.moe.SparseMoeBlock is the reference the tests hold it to, under TRITON_INTERPRET=1 on the CPU."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runlm.kernels.triton.ggml_matmul import BLOCKS, _weights

DENSE = 0  # QTYPE of stacked weights in the model's dtype (ggml's values for the block types: BLOCKS)


def align_pairs(chosen: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of ``chosen`` [T, k] sorted by expert, each expert's run padded to a multiple of
    ``block_m``: ``ids`` [P] (pair index t * k + slot; padding = T * k) and ``block_expert`` [P // block_m] (the
    expert of each block of rows, -1 for blocks past the last). P is fixed by T, k, the expert count and block_m."""
    flat = chosen.reshape(-1)
    pairs = flat.numel()
    used = min(experts, pairs)  # at most this many experts have a run, each padded by < block_m
    size = -(-(pairs + used * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # pairs by expert, in pair order within one
    expert_of = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts)[expert_of]
    ids = torch.full((size,), pairs, dtype=torch.int64, device=flat.device)
    ids.scatter_(0, (padded_end - padded)[expert_of] + rank, order)
    starts = torch.arange(0, size, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    return ids, torch.where(block_expert < experts, block_expert, -1)


@triton.jit
def _moe_kernel(x_ptr, w_ptr, y_ptr, ids_ptr, block_expert_ptr, scale_ptr, pairs, N, K, stride_x, expert_stride,
                row_stride, stride_y, ROW_DIV: tl.constexpr, SCALE: tl.constexpr, QTYPE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    ids = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < pairs
    rows = tl.where(valid, ids // ROW_DIV, 0).to(tl.int64)  # x's row: the pair's token (ROW_DIV = k) or the pair
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    w_e = w_ptr + e.to(tl.int64) * expert_stride
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + k0 + ks[None, :], mask=valid[:, None] & mask_k[None, :],
                    other=0.0)
        if QTYPE == 0:
            w = tl.load(w_e + tl.where(mask_n, cols, 0).to(tl.int64)[:, None] * row_stride + k0 + ks[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(x.dtype)
        else:  # (BLOCK_K = 32: one ggml block or sub-block)
            w = _weights(w_e, tl.where(mask_n, cols, 0), mask_n, k0, row_stride, QTYPE).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if SCALE:
        acc *= tl.load(scale_ptr + tl.where(valid, ids, 0), mask=valid, other=0.0)[:, None]
    y = y_ptr + tl.where(valid, ids, 0)[:, None] * stride_y + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def moe_matmul(x: torch.Tensor, w: torch.Tensor, qtype: int, ids: torch.Tensor, block_expert: torch.Tensor,
               block_m: int, pairs: int, row_div: int, out: torch.Tensor, scale: torch.Tensor | None = None
               ) -> torch.Tensor:
    """out[p] = x[p // row_div] @ W[expert of p]^T (x scale[p]) for every pair p named by ``ids``; ``w`` the experts
    stacked: [E, N, K] (qtype DENSE) or uint8 [E, N, row_bytes] in ggml type ``qtype``."""
    k, n = x.shape[1], w.shape[1]
    if qtype == DENSE and w.shape[2] != k:
        raise ValueError(f"experts take {w.shape[2]} inputs, not {k}")
    if qtype != DENSE:
        per_block, nbytes = BLOCKS[qtype]
        if k % per_block or w.shape[2] != k // per_block * nbytes:
            raise ValueError(f"expert rows of {w.shape[2]} bytes do not hold K={k} values")
    if x.stride(1) != 1 or not w.is_contiguous() or out.stride(1) != 1:
        raise ValueError("moe_matmul needs x's rows, the stacked weights and out's rows contiguous")
    block_n = 64
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_kernel[grid](x, w, out, ids, block_expert, scale if scale is not None else out, pairs, n, k,
                      x.stride(0), w.stride(0), w.stride(1), out.stride(0), ROW_DIV=row_div,
                      SCALE=scale is not None, QTYPE=qtype, BLOCK_M=block_m, BLOCK_N=block_n,
                      BLOCK_K=32 if qtype != DENSE else 64, IEEE=x.dtype == torch.float32)
    return out


def block_rows(tokens: int) -> int:
    """Rows a program takes: 16 at decode (a few pairs per expert), 64 for a prefill's many."""
    return 16 if tokens <= 32 else 64


def fused_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: torch.Tensor,
                  gate_up_type: int, down: torch.Tensor, down_type: int) -> torch.Tensor:
    """sum over each token's k experts of weight x down(SiLU(gate) * up) (x [T, H]; weights, chosen [T, k]; the
    experts' projections stacked as moe_matmul takes them): the routed part of a gated SiLU mixture of experts, as
    x's dtype."""
    from runlm.kernels.triton.fused import silu_mul

    t, top_k = chosen.shape
    x = x.contiguous()
    pairs, block_m = t * top_k, block_rows(t)
    ids, block_expert = align_pairs(chosen, gate_up.shape[0], block_m)
    h = moe_matmul(x, gate_up, gate_up_type, ids, block_expert, block_m, pairs, top_k,
                   torch.empty(pairs, gate_up.shape[1], dtype=x.dtype, device=x.device))
    act = silu_mul(h)
    hidden = down.shape[1]
    out = moe_matmul(act, down, down_type, ids, block_expert, block_m, pairs, 1,
                     torch.empty(pairs, hidden, dtype=torch.float32, device=x.device),
                     scale=weights.reshape(-1).float().contiguous())
    return out.view(t, top_k, hidden).sum(dim=1).to(x.dtype)
