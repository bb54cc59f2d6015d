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

import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_NAME = "runlm_linear_v1"
_SOURCE = Path(__file__).parent / "csrc" / "linear.cpp"
# -ffp-contract=off and no -ffast-math: the compiler must keep the written order of every sum.
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
# libgomp.so.1 resolves to the copy torch already loaded, so both share one OpenMP pool.
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_ext: ModuleType | None = None
_state: bool | None = None  # None: not tried yet


def _cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = set()
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
        return {"avx2", "fma"} <= flags
    except OSError:  # not Linux: ask torch, whose AVX2 level needs avx2 and fma
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; a venv used without activation has it only in bin/."""
    if shutil.which("ninja"):
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the PyPI wheel

        dirs.insert(0, ninja.BIN_DIR)
    except Exception:
        pass
    os.environ["PATH"] = os.pathsep.join(dirs + [os.environ.get("PATH", "")])


def _build_directory() -> Path:
    """Under the torch extensions cache (TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions), one
    folder per Python and torch version, so venvs with different torch builds do not share a .so."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    tag = f"runlm-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    path = Path(root) / tag / _NAME
    path.mkdir(parents=True, exist_ok=True)
    # A build killed midway leaves its lock file behind, and torch would wait on it forever.
    lock = path / "lock"
    try:
        if time.time() - lock.stat().st_mtime > 300:
            lock.unlink()
    except OSError:
        pass
    return path


def _build() -> bool:
    global _ext
    if os.environ.get("RUNLM_NO_KERNELS"):
        return False
    if not _cpu_has_avx2_fma():
        logger.info("runlm.kernels: CPU lacks AVX2/FMA; linear uses torch F.linear")
        return False
    try:
        _ensure_ninja_on_path()
        from torch.utils.cpp_extension import load

        _ext = load(
            name=_NAME,
            sources=[str(_SOURCE)],
            build_directory=str(_build_directory()),
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            verbose=False,
        )
        return True
    except Exception as e:  # no compiler, no ninja, a build error: fall back, never raise
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        keys = ("error:", "not found", "no such file")
        why = next((ln for ln in lines if any(k in ln.lower() for k in keys)), lines[-1] if lines else repr(e))
        logger.warning("runlm.kernels: could not build the linear kernel, using torch F.linear (%s)", why[:300])
        return False


def available() -> bool:
    """True once the kernel is compiled and loaded on an AVX2+FMA CPU. Never raises; cached."""
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _build()
    return _state


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]) -> [..., N]; batch-invariant on the fp32 CPU path.

    weight should be contiguous (a strided one is copied on every call)."""
    if _state or (_state is None and available()):
        y = _ext.linear(x, weight, bias)  # None: not fp32/CPU, or autograd wants a graph
        if y is not None:
            return y
    return F.linear(x, weight, bias)
