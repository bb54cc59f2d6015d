"""Compiles runlm's C++ CPU kernels on first use (torch.utils.cpp_extension) and loads them.

Each kernel is one source file in csrc/, built into its own extension module under the torch
extensions cache, one folder per Python and torch version (venvs with different torch builds
never share a .so). A kernel that cannot be built (no compiler, no ninja, a CPU without
AVX2/FMA, RUNLM_NO_KERNELS set) is reported unavailable once, and callers use torch instead.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from runlm.native.host import CFLAGS, LDFLAGS, cpu_has_avx2_fma

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


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


def _build_directory(name: str) -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    tag = f"runlm-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    path = Path(root) / tag / name
    path.mkdir(parents=True, exist_ok=True)
    # A build killed midway leaves its lock file behind, and torch would wait on it forever.
    lock = path / "lock"
    try:
        if time.time() - lock.stat().st_mtime > 300:
            lock.unlink()
    except OSError:
        pass
    return path


def _import_built(name: str) -> ModuleType | None:
    """The module from an earlier build of exactly this source and flags (its folder is named after
    their hash), imported straight away: a second start runs no ninja and no compiler check."""
    directory = _build_directory(name)
    so = directory / f"{name}.so"
    if not so.is_file() or (directory / "lock").exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, so)
        if spec is None or spec.loader is None:
            raise ImportError(f"no loader for {so}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError as e:  # a partial or foreign build: build again
        logger.info("runlm.kernels: rebuilding %s (%s)", name, e)
        return None


def _build(name: str, source: str, cflags: list[str], ldflags: list[str]) -> ModuleType | None:
    if os.environ.get("RUNLM_NO_KERNELS"):
        return None
    if not cpu_has_avx2_fma():
        logger.info("runlm.kernels: CPU lacks AVX2/FMA; %s uses torch", name)
        return None
    built = _import_built(name)
    if built is not None:
        return built
    try:
        _ensure_ninja_on_path()
        from torch.utils.cpp_extension import load

        return load(name=name, sources=[str(CSRC / source)], build_directory=str(_build_directory(name)),
                    extra_cflags=CFLAGS + cflags, extra_ldflags=LDFLAGS + ldflags, verbose=False)
    except Exception as e:  # no compiler, no ninja, a build error: fall back, never raise
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        keys = ("error:", "not found", "no such file")
        why = next((ln for ln in lines if any(k in ln.lower() for k in keys)), lines[-1] if lines else repr(e))
        logger.warning("runlm.kernels: could not build %s, using torch instead (%s)", name, why[:300])
        return None


def load_kernel(name: str, source: str, cflags: tuple[str, ...] = (),
                ldflags: tuple[str, ...] = ()) -> ModuleType | None:
    """The compiled module for csrc/<source>, or None when it cannot be had. Never raises; cached.

    The build is named after a hash of the source and flags, so two checkouts with different
    sources never share (and keep rebuilding) one build folder."""
    if name not in _loaded:
        with _lock:
            if name not in _loaded:
                flags = " ".join([*CFLAGS, *cflags, *ldflags]).encode()
                headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # what sources include
                digest = hashlib.sha256((CSRC / source).read_bytes() + headers + flags).hexdigest()
                _loaded[name] = _build(f"{name}_{digest[:12]}", source, list(cflags), list(ldflags))
    return _loaded[name]


class LazyKernel:
    """One kernel module, built or imported on first use. ``module`` is None where it cannot be had
    (no compiler, no AVX2/FMA, RUNLM_NO_KERNELS...); ``available()`` never raises."""

    __slots__ = ("name", "source", "cflags", "ldflags", "module", "_tried")

    def __init__(self, name: str, source: str, cflags: tuple[str, ...] = (), ldflags: tuple[str, ...] = ()) -> None:
        self.name, self.source, self.cflags, self.ldflags = name, source, cflags, ldflags
        self.module: ModuleType | None = None
        self._tried = False

    def available(self) -> bool:
        if not self._tried:
            self.module = load_kernel(self.name, self.source, self.cflags, self.ldflags)
            self._tried = True
        return self.module is not None

    def loaded(self) -> ModuleType:
        """The module; call available() first."""
        assert self.module is not None, f"runlm.kernels: {self.name} is unavailable"
        return self.module
