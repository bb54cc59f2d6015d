"""Fused per-layer ops for the fast decode path (csrc/fused_ops.cpp): RMSNorm (with the residual add),
SiLU·mul, and QKV split + q/k norm + RoPE + KV-cache write in one call. Unavailable (no compiler, no
AVX2/FMA, RUNLM_NO_KERNELS): the model runs its torch ops instead."""
from __future__ import annotations

from types import ModuleType

from runlm.kernels.build import LazyKernel

_kernel = LazyKernel("runlm_fused_ops", "fused_ops.cpp")


def available() -> bool:
    """True once compiled and loaded on an AVX2+FMA CPU. Never raises; cached."""
    return _kernel.available()


def ops() -> ModuleType:
    """The extension module (rms_norm, add_rms_norm, silu_mul, qkv_rope_store); call available() first."""
    assert _kernel.module is not None, "runlm.kernels.fused is unavailable"
    return _kernel.module
