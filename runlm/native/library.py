"""The loaded native library (runlm.native.build) with every function's ctypes signature declared once,
and the argument checks the bindings (kernels.py, decoder.py) share: arrays go in as their addresses
after a dtype / contiguity / shape check, and a native error comes back as ValueError."""
from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from ctypes import POINTER, c_float, c_int, c_int64, c_void_p

import numpy as np

from runlm.native import build

F32, F16, I64, U8 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int64), np.dtype(np.uint8)
_P = c_void_p  # every array goes in as its address


def _declare(library: ctypes.CDLL) -> None:
    signatures: dict[str, tuple[object, list[object]]] = {
        "runlm_last_error": (ctypes.c_char_p, []),
        "runlm_set_threads": (None, [c_int]),
        "runlm_get_threads": (c_int, []),
        "runlm_cpu_features": (ctypes.c_char_p, []),
        "runlm_supported": (c_int, [c_int64]),
        "runlm_row_bytes": (c_int64, [c_int64, c_int64]),
        "runlm_block_size": (c_int64, [c_int64]),
        "runlm_linear_new": (c_void_p, [c_int64, POINTER(c_void_p), POINTER(c_int64), POINTER(c_int64),
                                        POINTER(c_int64), c_int64, _P]),
        "runlm_linear_free": (None, [c_void_p]),
        "runlm_linear_packed": (c_int, [c_void_p, c_int64]),
        "runlm_linear": (c_int, [c_void_p, _P, c_int64, _P]),
        "runlm_embedding": (c_int, [_P, c_int64, _P, c_int64, c_int64, c_int64, c_int64, _P]),
        "runlm_dequantize": (c_int, [_P, c_int64, c_int64, c_int64, c_int64, _P]),
        "runlm_rms_norm": (None, [_P, _P, _P, c_int64, c_int64, c_float]),
        "runlm_add_rms_norm": (None, [_P, _P, _P, _P, c_int64, c_int64, c_float]),
        "runlm_silu_mul": (None, [_P, _P, c_int64, c_int64]),
        "runlm_gelu_tanh_mul": (None, [_P, _P, c_int64, c_int64]),
        "runlm_qkv_rope_store": (c_int, [_P, _P, _P, _P, c_int64, _P, _P, c_int64, _P, c_int64, c_int64, c_int64,
                                         c_int64, c_int, _P, _P, c_float, _P]),
        "runlm_paged_attention": (c_int, [_P, _P, _P, c_int64, _P, c_int64, _P, _P, c_int64, c_int64, c_int64,
                                          c_int64, c_int64, c_float, c_int64, c_float, _P]),
        "runlm_decoder_new": (c_void_p, [c_int64, c_int64, c_int64, c_int64, c_float, c_int, _P, c_int64, c_int64,
                                         c_int64, c_float, _P, c_int64]),
        "runlm_decoder_free": (None, [c_void_p]),
        "runlm_decoder_set_layer": (c_int, [c_void_p, c_int64, c_void_p, c_void_p, c_void_p, c_void_p, _P, _P, _P,
                                            _P, _P, _P, _P, _P, c_int64, c_float, c_int64, c_float, c_int]),
        "runlm_decoder_set_cache": (c_int, [c_void_p, c_int64, _P, _P, c_int64]),
        "runlm_decoder_set_cache_packed": (c_int, [c_void_p, c_int64, _P, _P, c_int64, c_int]),
        "runlm_kv_q8_quantize": (c_int, [_P, c_int64, c_int64, _P]),
        "runlm_decoder_check": (c_int, [c_void_p]),
        "runlm_decoder_forward": (c_int, [c_void_p, _P, _P, _P, c_int64, _P, _P, c_int64, _P, c_int64, _P]),
        "runlm_decoder_forward_embeds": (c_int, [c_void_p, _P, _P, _P, c_int64, _P, _P, c_int64, _P, c_int64, _P, _P,
                                                 _P, c_int64]),
        "runlm_decoder_set_lora": (c_int, [c_void_p, c_int64, c_int64, c_int, _P, c_int64, c_int64, c_int64, _P, _P,
                                           c_int]),
        "runlm_decoder_drop_lora": (None, [c_void_p, c_int64]),
        "runlm_decoder_set_lora_rows": (c_int, [c_void_p, _P, c_int64]),
        "runlm_moe_new": (c_void_p, [c_int64, c_int64, c_int, c_int64, c_int64, _P, c_int64, _P, c_int64, _P,
                                     c_int64, _P, c_int64, c_int]),
        "runlm_moe_free": (None, [c_void_p]),
        "runlm_moe_set_shared": (c_int, [c_void_p, c_void_p, c_void_p, _P]),
        "runlm_moe_set_oai": (c_int, [c_void_p, _P, _P, _P, c_float]),
        "runlm_decoder_set_layer_sinks": (c_int, [c_void_p, c_int64, _P]),
        "runlm_moe_forward": (c_int, [c_void_p, _P, c_int64, _P]),
        "runlm_decoder_set_layer_moe": (c_int, [c_void_p, c_int64, c_void_p]),
        "runlm_decoder_set_layer_family": (c_int, [c_void_p, c_int64, c_int64, c_int, c_int64]),
        "runlm_decoder_forward_groups": (c_int, [c_void_p, _P, _P, _P, c_int64, _P, _P, c_int64, _P, c_int64, _P, _P,
                                                 _P, c_int64, c_int64, _P, _P]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(library, name)
        fn.restype, fn.argtypes = restype, argtypes


_lib: ctypes.CDLL | None = None


def available() -> bool:
    """True once the library is built (or found in the cache) and loaded. Never raises; cached."""
    global _lib
    if _lib is None:
        loaded = build.load()
        if loaded is None:
            return False
        _declare(loaded)
        _lib = loaded
    return True


def lib() -> ctypes.CDLL:
    """The library, its signatures declared; RuntimeError where it is unavailable."""
    if _lib is None and not available():
        raise RuntimeError(f"runlm's native kernels are unavailable ({build.why_unavailable})")
    assert _lib is not None
    return _lib


def ok(code: int) -> None:
    """Raises the library's last error for a negative return code."""
    if code < 0:
        raise ValueError(lib().runlm_last_error().decode())


# array id -> (a weak reference to it, its data address): numpy takes 1-2 µs to tell an address, and the
# runner passes the same preallocated arrays every step. An entry goes when its array does.
_addresses: dict[int, tuple[weakref.ref, int]] = {}


def _forget(key: int) -> Callable[[object], object]:
    return lambda _: _addresses.pop(key, None)


def ptr(a: np.ndarray) -> int:
    """a's data address (an array's data never moves while it lives: numpy's resize refuses a referenced one).
    Only arrays that own their data are remembered: a view is usually made anew for each call."""
    if a.base is not None:
        return a.ctypes.data
    key = id(a)
    hit = _addresses.get(key)
    if hit is not None and hit[0]() is a:
        return hit[1]
    address = a.ctypes.data
    _addresses[key] = (weakref.ref(a, _forget(key)), address)
    return address


def arr(a: np.ndarray, dtype: np.dtype, name: str, ndim: int | None = None) -> int:
    """a's address after checking that it is a C-contiguous array of dtype (and ndim dims)."""
    if not isinstance(a, np.ndarray) or a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous {dtype} numpy array")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, not {a.ndim}")
    return ptr(a)


def check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ValueError(f"{name} has shape {got}, expected {want}")


def vector(a: np.ndarray, name: str, n: int) -> int:
    """The address of an fp32 [n] array."""
    if a is None:
        raise ValueError(f"{name} is required")
    check_shape(name, a.shape, (n,))
    return arr(a, F32, name)


def optional_f32(a: np.ndarray | None, name: str, n: int) -> int | None:
    """vector(a), or None (a null pointer) where a is None."""
    return None if a is None else vector(a, name, n)


class Handle:
    """A native object (a linear layer's plan, a decoder) owned by Python: freed by ``close()`` or when
    collected, by the library function named ``free``."""

    def __init__(self, handle: int | None, free: str, what: str) -> None:
        if not handle:
            raise ValueError(lib().runlm_last_error().decode())
        self._handle: int | None = handle
        self._free = getattr(lib(), free)
        self._what = what

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise ValueError(f"this {self._what} is closed")
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            self._free(self._handle)
            self._handle = None

    def __del__(self) -> None:
        if getattr(self, "_handle", None) is not None:
            self.close()
