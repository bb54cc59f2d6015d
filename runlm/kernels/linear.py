"""Batch-invariant fp32 linear layer (AVX2 + FMA C++ kernel, compiled on first use).

``linear(x, weight, bias)`` computes ``x @ weight.T + bias`` like ``torch.nn.functional.linear``,
but every output element is reduced over K in one fixed order that depends only on K, so a
row's result is bitwise identical whatever the batch size, the row's position in the batch or
the thread count (see csrc/linear.cpp for the order). It is also faster than MKL for small
batches (decode). Anything the kernel does not cover (non-fp32, non-CPU, autograd, a CPU
without AVX2/FMA, no compiler) goes to ``F.linear``; so does everything when the environment
variable RUNLM_NO_KERNELS is set (checked once, at the first call).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runlm.kernels.build import LazyKernel

_kernel = LazyKernel("runlm_linear", "linear.cpp")


def available() -> bool:
    """True once compiled and loaded on an AVX2+FMA CPU. Never raises; cached."""
    return _kernel.available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]) -> [..., N]; batch-invariant on the fp32 CPU path.

    weight should be contiguous (a strided one is copied on every call). A tensor off the CPU never asks for the
    kernel (a GPU run compiles no CPU code)."""
    if x.device.type == "cpu" and available():
        y = _kernel.loaded().linear(x, weight, bias)  # None: not fp32/CPU, or autograd wants a graph
        if y is not None:
            return y
    return F.linear(x, weight, bias)


def dequantize_blocks(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] with fp32 [N, K/32] scales and offsets -> fp32 [N, K], as q * scale + offset."""
    n, k = qweight.shape
    w = qweight.float().view(n, k // 32, 32) * scales[:, :, None]
    return (w + offsets[:, :, None]).view(n, k)


def linear_q8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear`` with block-quantized weights (w = q * scale + offset per 32 values along K), dequantized in
    registers: bitwise the fp32 kernel's result on the dequantized weights, reading a quarter of the bytes."""
    if x.device.type == "cpu" and available():
        y = _kernel.loaded().linear_q8(x, qweight, scales, offsets, bias)
        if y is not None:
            return y
    return F.linear(x, dequantize_blocks(qweight, scales, offsets).to(x.dtype), bias)
