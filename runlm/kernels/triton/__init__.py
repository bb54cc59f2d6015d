"""Triton kernels for the GPU runner: unified paged attention and the KV store (attention.py, kv_store.py), their
torch references (reference.py) and the AttentionBackend that uses them (backend.py). Triton is optional: import
the submodules only where ``available()`` says it is installed (the backend checks for you)."""
from __future__ import annotations

import functools
import importlib.util


def available() -> bool:
    """Whether Triton is installed (it runs on CUDA, or anywhere under TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def runs_on(device_type: str) -> bool:
    """Whether tensors on this kind of device take the Triton kernels (CUDA, or anywhere under TRITON_INTERPRET=1,
    with Triton installed): asked once per kind of device (a CPU run without the interpreter pays a cached lookup)."""
    import torch

    from runlm.kernels.triton.backend import use_triton_on

    return use_triton_on(torch.device(device_type))
