"""LoRA on the GPU runner's device, many adapters in one batch (Punica's BGMV, S-LoRA; vLLM's ``lora/ops`` is the
shape learned from, the code is ours): every adapted linear layer holds its adapters in slots, device buffers
written when an adapter is attached (runlm.models.lora.DeviceLoRA), and each row of a step names its slot (-1:
none). Two kernels add the update to the layer's base output:

- shrink: h[t] = x[t] @ A[slot[t]]^T         A [S, R, K]: every projection's A of the layer stacked (R = the slots'
                                              rank room), h in float32;
- expand: y[t] += h[t] @ B[slot[t]]^T         B [S, N, R]: each projection's B at its output rows and rank columns
                                              (zeros elsewhere), so one pass covers q, k and v (or gate and up).

A program takes one row and one tile of R (shrink) or N (expand): the row's slot picks the weights, rows without an
adapter return at once. Nothing is grouped on the host and nothing read back, so CUDA graphs capture the step with
its adapters, and attaching or removing one writes the slots, with no recapture. runlm.models.lora's torch path
(rows grouped by adapter) is the reference the tests hold these to, under TRITON_INTERPRET=1 on the CPU."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, slots_ptr, K, R, stride_x, stride_as, stride_ar, stride_h,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = r < R
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + r[:, None] * stride_ar
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < K
        x = tl.load(x_ptr + t.to(tl.int64) * stride_x + k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t.to(tl.int64) * stride_h + r, acc, mask=mask_r)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, slots_ptr, N, R, stride_h, stride_bs, stride_bn, stride_y,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = n < N
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    mask_r = r < R
    h = tl.load(h_ptr + t.to(tl.int64) * stride_h + r, mask=mask_r, other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + n[:, None] * stride_bn + r[None, :],
                mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
    y = y_ptr + t.to(tl.int64) * stride_y + n
    base = tl.load(y, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y, (base + tl.sum(b * h[None, :], axis=1)).to(y_ptr.dtype.element_ty), mask=mask_n)


def add_lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y [T, N] += (x [T, K] @ a[slot]^T) @ b[slot]^T row by row, in place (a [S, R, K], b [S, N, R]; slots [T],
    -1: the row has no adapter); returns y."""
    t, k = x.shape
    s, r, ka = a.shape
    n = y.shape[1]
    if ka != k or b.shape != (s, n, r) or slots.shape[0] < t:
        raise ValueError(f"LoRA slots A {tuple(a.shape)} and B {tuple(b.shape)} do not fit x {tuple(x.shape)} and "
                         f"y {tuple(y.shape)}")
    if x.stride(1) != 1 or y.stride(1) != 1 or not a.is_contiguous() or not b.is_contiguous():
        raise ValueError("add_lora needs x's and y's rows and the slots' buffers contiguous")
    if t == 0:
        return y
    h = torch.zeros(t, r, dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(r))
    _shrink_kernel[(t, triton.cdiv(r, block_r))](x, a, h, slots, k, r, x.stride(0), a.stride(0), a.stride(1),
                                                  h.stride(0), BLOCK_R=block_r, BLOCK_K=128)
    _expand_kernel[(t, triton.cdiv(n, 64))](h, b, y, slots, n, r, h.stride(0), b.stride(0), b.stride(1),
                                            y.stride(0), BLOCK_N=64, BLOCK_R=triton.next_power_of_2(r))
    return y
