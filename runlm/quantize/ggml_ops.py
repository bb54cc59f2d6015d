"""ggml's own quantizers (libggml-base from the libggml-python wheel), through ctypes: every row a GGUF block type
is written by the same code llama.cpp's ``llama-quantize`` runs, so the same floats give the same bytes.

ctypes releases the GIL for each call, so threads quantize row slabs side by side.
"""
from __future__ import annotations

import ctypes
from functools import cache

import numpy as np

from runlm.native.host import libggml


class QuantizerUnavailable(RuntimeError):
    """libggml-python is not installed (or its library cannot be loaded)."""


@cache
def _lib() -> ctypes.CDLL:
    found = libggml()
    if found is None:
        raise QuantizerUnavailable("quantizing needs ggml's quantizers: pip install libggml-python")
    try:
        lib = ctypes.CDLL(str(found.lib / "libggml-base.so"))
    except OSError as exc:
        raise QuantizerUnavailable(f"cannot load libggml-base: {exc}") from None
    i64, size = ctypes.c_int64, ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, i64, i64, i64,
                                        ctypes.c_void_p]
    lib.ggml_quantize_chunk.restype = size
    lib.ggml_row_size.argtypes = [ctypes.c_int, i64]
    lib.ggml_row_size.restype = size
    lib.ggml_blck_size.argtypes = [ctypes.c_int]
    lib.ggml_blck_size.restype = i64
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_validate_row_data.argtypes = [ctypes.c_int, ctypes.c_void_p, size]
    lib.ggml_validate_row_data.restype = ctypes.c_bool
    return lib


def available() -> bool:
    try:
        _lib()
    except QuantizerUnavailable:
        return False
    return True


def row_size(qtype: int, n: int) -> int:
    return int(_lib().ggml_row_size(qtype, n))


def block_size(qtype: int) -> int:
    return int(_lib().ggml_blck_size(qtype))


def requires_imatrix(qtype: int) -> bool:
    return bool(_lib().ggml_quantize_requires_imatrix(qtype))


def quantize_rows(qtype: int, rows: np.ndarray, out: np.ndarray, imatrix: np.ndarray | None) -> None:
    """``rows`` [n, k] float32 (C order) quantized into ``out`` (uint8, n * row_size bytes); checked as llama.cpp
    checks its own output (ggml_validate_row_data: no NaN or inf scales)."""
    lib = _lib()
    n, k = rows.shape
    size = row_size(qtype, k) * n
    if not rows.flags.c_contiguous or rows.dtype != np.float32 or out.nbytes < size or not out.flags.c_contiguous:
        raise ValueError("quantize_rows needs C-ordered float32 rows and a large enough output")
    imat = None if imatrix is None else imatrix.ctypes.data
    written = lib.ggml_quantize_chunk(qtype, rows.ctypes.data, out.ctypes.data, 0, n, k, imat)
    if written != size or not lib.ggml_validate_row_data(qtype, out.ctypes.data, size):
        raise ValueError("quantized data failed validation (NaN or inf in the weights?)")
