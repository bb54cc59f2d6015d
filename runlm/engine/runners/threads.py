"""The CPU threads of whichever computes: torch's intra-op pool or the native library's workers."""
from __future__ import annotations


def set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def set_native_threads(n: int) -> None:
    from runlm.native import kernels

    kernels.set_threads(n)
