"""GGUF weights computed on as stored: ggml's CPU type traits behind one small C++ extension.

The prebuilt ``libggml-python`` wheel ships ggml's CPU backend (its quantizers and integer dot
products for every block type, with run-time AVX2 / AVX-512 / VNNI dispatch) and headers;
csrc/ggml_linear.cpp links it and adds the loops: quantize each activation row once to the
weight type's ``vec_dot_type`` (Q8_0, Q8_1, Q8_K, F16...), then one dot product per output,
threads splitting the output rows. ggml's vec_dot computes one (weight row, activation row) pair per call and
ends each with a horizontal sum, so a prefill of M rows unpacks every weight block M times. For
the types real files are made of (Q8_0, Q4_0, Q5_0, Q4_1, Q5_1 and the K-quants Q4_K, Q5_K,
Q6_K) runlm has its own kernels (csrc/block_gemm.h, csrc/kquant_gemm.h): 8 weight rows are
unpacked once per block and multiplied into every activation row, the 8 results landing in 8
SIMD lanes. bench/quant_gemm_bench.py (Qwen2.5-0.5B's layers, 1 thread, AVX2) measures them
against vec_dot: at M = 128 3-4x faster for the 32-value types and 1.6-3x for the K-quants; at
M = 1 (decode, memory-bound) level or faster. Each output's arithmetic is the exact integer dot
product per block, converted once and accumulated in block order, so every M, chunk and thread
count gives the same bits. Half-precision weights (F16, BF16: safetensors checkpoints as stored)
go through csrc/half_gemm.h: tiles of 4 weight rows x 2 activation rows share each widened step
(each output's lanes accumulated in K order, so again the same bits for every M; about 1.6-2x
vec_dot at M = 64). Other types (IQ4_NL, IQ4_XS, Q2_K, Q3_K) use ggml's vec_dot.

Types are ggml's enum values (``gguf.GGMLQuantizationType``). Unavailable (no libggml, no
compiler, no AVX2/FMA, RUNLM_NO_KERNELS) means callers fall back to dequantized fp32 weights.
"""
from __future__ import annotations

import logging
from types import ModuleType

import torch

from runlm.kernels.build import LazyKernel
from runlm.native.host import libggml

logger = logging.getLogger(__name__)


def _kernel() -> LazyKernel | None:
    """The extension, linked against the wheel's libggml; None where libggml-python is not installed."""
    lib = libggml()
    if lib is None:
        return None
    return LazyKernel("runlm_ggml_linear", "ggml_linear.cpp", cflags=tuple(lib.cflags()), ldflags=tuple(lib.ldflags()))


_KERNEL = _kernel()
_reported = False


def available() -> bool:
    """True once the extension is built and loaded. Never raises; cached."""
    global _reported
    ok = _KERNEL is not None and _KERNEL.available()
    if not _reported:
        _reported = True
        if _KERNEL is None:
            logger.info("runlm.kernels: libggml-python is not installed; quantized weights are dequantized")
        elif ok:
            logger.info("runlm.kernels: ggml dot products on %s", _KERNEL.loaded().cpu_features() or "no SIMD")
    return ok


def module() -> ModuleType:
    if not available() or _KERNEL is None:
        raise RuntimeError("runlm's ggml kernels are unavailable (see the log for why)")
    return _KERNEL.loaded()


def supported(qtype: int) -> bool:
    """Whether ggml has a CPU dot product for weights of this type (and the extension is here)."""
    return available() and bool(module().supported(int(qtype)))


def cpu_features() -> str:
    return module().cpu_features() if available() else ""


def linear(x: torch.Tensor, weights: list[torch.Tensor], types: list[int],
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 times the concatenated segments' rows -> [..., sum N_i]; a segment is a raw
    uint8 [N_i, row_bytes] tensor of ggml type types[i]."""
    return module().linear(x, weights, types, bias)


def embedding(ids: torch.Tensor, table: torch.Tensor, qtype: int, dim: int) -> torch.Tensor:
    """Rows ``ids`` of a raw [V, row_bytes] table, dequantized to fp32 [..., dim]."""
    return module().embedding(ids, table, int(qtype), dim)


def dequantize(table: torch.Tensor, qtype: int, dim: int) -> torch.Tensor:
    """A raw [N, row_bytes] table of ggml type ``qtype`` as fp32 [N, dim]."""
    return module().dequantize(table, int(qtype), dim)


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """fp32 [N, K] -> raw uint8 [N, row_bytes] of ggml type ``qtype`` (ggml's own quantizer)."""
    return module().quantize(weight, int(qtype))


def block_size(qtype: int) -> int:
    """Values per block of this type (32, or 256 for the K-quants; 1 for F32/F16/BF16)."""
    return int(module().block_size(int(qtype)))


def row_bytes(qtype: int, dim: int) -> int:
    return int(module().row_bytes(int(qtype), dim))
