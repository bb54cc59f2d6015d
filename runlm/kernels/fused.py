"""Fused per-layer ops for the fast decode path (csrc/fused_ops.cpp): RMSNorm (with the residual add),
SiLU·mul, and QKV split + q/k norm + RoPE + KV-cache write in one call. Unavailable (no compiler, no
AVX2/FMA, RUNLM_NO_KERNELS): the model runs its torch ops instead."""
from __future__ import annotations

from types import ModuleType

from runlm.kernels.build import load_kernel

_ext: ModuleType | None = None
_state: bool | None = None


def available() -> bool:
    global _ext, _state
    if _state is None:
        _ext = load_kernel("runlm_fused_ops", "fused_ops.cpp")
        _state = _ext is not None
    return _state


def ops() -> ModuleType:
    """The extension module (rms_norm, add_rms_norm, silu_mul, qkv_rope_store); call available() first."""
    assert _ext is not None, "runlm.kernels.fused is unavailable"
    return _ext
