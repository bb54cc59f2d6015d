"""GGUF weights computed on as stored: ggml's CPU type traits behind one small C++ extension.

The prebuilt ``libggml-python`` wheel ships ggml's CPU backend (its quantizers and integer dot
products for every block type, with run-time AVX2 / AVX-512 / VNNI dispatch) and headers;
csrc/ggml_linear.cpp links it and adds the loops: quantize each activation row once to the
weight type's ``vec_dot_type`` (Q8_0, Q8_1, Q8_K, F16...), then one dot product per output,
threads splitting the output rows. We measured these dot products against our own int8 kernel
(bench/gemm_bench.py): they read 0.56-1.06 bytes per weight instead of 1.25 and use maddubs,
so they are the faster choice for every type at decode, and the only one for K-quants and IQ4.

Types are ggml's enum values (``gguf.GGMLQuantizationType``). Unavailable (no libggml, no
compiler, no AVX2/FMA, RUNLM_NO_KERNELS) means callers fall back to dequantized fp32 weights.
"""
from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import torch

from runlm.kernels.build import load_kernel

logger = logging.getLogger(__name__)

_ext: ModuleType | None = None
_state: bool | None = None


def _libggml() -> Path | None:
    try:
        import libggml
    except ImportError:
        return None
    root = Path(libggml.__file__).parent
    return root if (root / "include" / "ggml-cpu.h").is_file() else None


def available() -> bool:
    """True once the extension is built and loaded. Never raises; cached."""
    global _ext, _state
    if _state is None:
        root = _libggml()
        if root is None:
            logger.info("runlm.kernels: libggml-python is not installed; quantized weights are dequantized")
            _ext = None
        else:
            lib = root / "lib64" if (root / "lib64").is_dir() else root / "lib"
            _ext = load_kernel("runlm_ggml_linear", "ggml_linear.cpp", cflags=(f"-I{root / 'include'}", "-mf16c"),
                               ldflags=(f"-L{lib}", "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{lib}"))
        _state = _ext is not None
        if _state:
            logger.info("runlm.kernels: ggml dot products on %s", _ext.cpu_features() or "no SIMD")
    return _state


def _module() -> ModuleType:
    if not available():
        raise RuntimeError("runlm's ggml kernels are unavailable (see the log for why)")
    return _ext


def supported(qtype: int) -> bool:
    """Whether ggml has a CPU dot product for weights of this type (and the extension is here)."""
    return available() and bool(_ext.supported(int(qtype)))


def cpu_features() -> str:
    return _ext.cpu_features() if available() else ""


def linear(x: torch.Tensor, weights: list[torch.Tensor], types: list[int],
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 times the concatenated segments' rows -> [..., sum N_i]; a segment is a raw
    uint8 [N_i, row_bytes] tensor of ggml type types[i]."""
    return _module().linear(x, weights, types, bias)


def embedding(ids: torch.Tensor, table: torch.Tensor, qtype: int, dim: int) -> torch.Tensor:
    """Rows ``ids`` of a raw [V, row_bytes] table, dequantized to fp32 [..., dim]."""
    return _module().embedding(ids, table, int(qtype), dim)


def dequantize(table: torch.Tensor, qtype: int, dim: int) -> torch.Tensor:
    """A raw [N, row_bytes] table of ggml type ``qtype`` as fp32 [N, dim]."""
    return _module().dequantize(table, int(qtype), dim)


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """fp32 [N, K] -> raw uint8 [N, row_bytes] of ggml type ``qtype`` (ggml's own quantizer)."""
    return _module().quantize(weight, int(qtype))


def row_bytes(qtype: int, dim: int) -> int:
    return int(_module().row_bytes(int(qtype), dim))
