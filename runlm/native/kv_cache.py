"""The native runner's KV cache arrays: fp32 or fp16 [slots, kv_heads, head_dim] (``fp32`` or ``auto``;
``fp16``: the engine's ``auto`` on this runner), or llama.cpp's q8_0 blocks (``q8_0``: uint8 [slots, kv_heads,
head_dim / 32 * 34], an fp16 scale and 32 int8 per 32 values, csrc/kv_q8_impl.h), which hold ~3.76x the tokens of
fp32 in the same memory. K/V are packed as they are written and unpacked as attention reads them; nothing else
in the step changes."""
from __future__ import annotations

import numpy as np

from runlm.kv_size import Q8_BLOCK, check_kv_cache_dtype, q8_row_bytes
from runlm.native.library import F16, F32, U8, arr, lib, ok

__all__ = ["allocate", "q8_row_bytes", "quantize_q8", "why_not_q8"]


def why_not_q8(head_dim: int) -> str | None:
    """Why a model cannot keep a q8_0 cache (None: it can)."""
    return None if head_dim % Q8_BLOCK == 0 else f"a q8_0 KV cache needs head_dim a multiple of 32, not {head_dim}"


def allocate(kv_cache_dtype: str, slots: int, kv_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (k, v) cache. Empty, not zeros: attention reads only slots already written, and untouched
    pages cost no RAM."""
    kind = check_kv_cache_dtype(kv_cache_dtype)
    if kind == "q8_0":
        reason = why_not_q8(head_dim)
        if reason is not None:
            raise ValueError(reason)
        shape = (slots, kv_heads, q8_row_bytes(head_dim))
        return np.empty(shape, dtype=U8), np.empty(shape, dtype=U8)
    shape, dtype = (slots, kv_heads, head_dim), F16 if kind == "fp16" else F32  # ("auto" here: fp32)
    return np.empty(shape, dtype=dtype), np.empty(shape, dtype=dtype)


def quantize_q8(x: np.ndarray) -> np.ndarray:
    """Rows x [n, d] (fp32, d a multiple of 32) as the q8_0 cache stores them: uint8 [n, d / 32 * 34]."""
    xp = arr(x, F32, "x", 2)
    out = np.empty((x.shape[0], q8_row_bytes(x.shape[1])), dtype=U8)
    ok(lib().runlm_kv_q8_quantize(xp, x.shape[0], x.shape[1], out.ctypes.data))
    return out
