"""Builds runlm's torch-free kernel library (runlm/kernels/csrc/native_abi.cpp) with the system C++
compiler and loads it with ctypes. Never imports torch.

The library is cached under ``$RUNLM_KERNEL_CACHE`` (default ``~/.cache/runlm/native``) in a folder
named after a hash of the sources, the headers they include, the flags (which carry libggml's paths)
and the Python tag, so a second start only opens the file. Two processes building at once each compile
into a temporary file and rename it into place: the rename is atomic and the last one wins with the
same bytes; nothing is left behind that could go stale. Where the library cannot be had (no compiler,
no libggml-python, a CPU without AVX2/FMA, RUNLM_NO_KERNELS set) ``load()`` returns None and says why
once in the log.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from runlm.native.host import CFLAGS, LDFLAGS, cpu_has_avx2_fma, libggml

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "kernels" / "csrc"
SOURCE = CSRC / "native_abi.cpp"
LIBRARY = "librunlm_native.so"
_BUILD_FLAGS = ["-shared", "-fPIC", "-std=c++17"]

_lock = threading.Lock()
_tried = False
_library: ctypes.CDLL | None = None
why_unavailable = ""  # the reason load() returned None, for messages


def cache_root() -> Path:
    if os.environ.get("RUNLM_KERNEL_CACHE"):
        return Path(os.environ["RUNLM_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "runlm" / "native"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "c++")


def _command(cxx: str, output: Path, cflags: list[str], ldflags: list[str]) -> list[str]:
    return [cxx, *CFLAGS, *cflags, *_BUILD_FLAGS, str(SOURCE), "-o", str(output), *LDFLAGS, *ldflags]


def library_path(cflags: list[str], ldflags: list[str]) -> Path:
    """Where the build of the present sources with these flags lives (whether or not it exists yet)."""
    digest = hashlib.sha256()
    for path in [SOURCE, *sorted(CSRC.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join([*CFLAGS, *cflags, *_BUILD_FLAGS, *LDFLAGS, *ldflags]).encode())
    digest.update(sys.implementation.cache_tag.encode())
    return cache_root() / digest.hexdigest()[:16] / LIBRARY


def _first_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no output")[:300]


def _compile(target: Path, cflags: list[str], ldflags: list[str]) -> str:
    """Builds the library at target; "" on success, else the compiler's first error line."""
    cxx = compiler()
    if cxx is None:
        return f"no C++ compiler ({os.environ.get('CXX') or 'c++'} is not on PATH)"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{LIBRARY}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(_command(cxx, Path(tmp), cflags, ldflags), capture_output=True, text=True)
        if done.returncode != 0:
            return _first_error(done.stderr or done.stdout)
        os.replace(tmp, target)  # atomic: a racing build renames the same bytes over it
        return ""
    except OSError as e:
        return str(e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL | None:
    global why_unavailable
    if os.environ.get("RUNLM_NO_KERNELS"):
        why_unavailable = "RUNLM_NO_KERNELS is set"
        return None
    if not cpu_has_avx2_fma():
        why_unavailable = "the CPU lacks AVX2/FMA"
        return None
    lib = libggml()
    if lib is None:
        why_unavailable = "libggml-python is not installed"
        return None
    cflags, ldflags = lib.cflags(), lib.ldflags()
    try:
        target = library_path(cflags, ldflags)
        if not target.is_file():
            logger.info("runlm.native: building %s", target)
            error = _compile(target, cflags, ldflags)
            if error:
                why_unavailable = f"could not build {SOURCE.name}: {error}"
                return None
        library = ctypes.CDLL(str(target))
        library.runlm_init()
        return library
    except Exception as e:  # an unreadable cache, a library that does not load: report, never raise
        why_unavailable = f"could not load the native kernels: {e}"
        return None


def load() -> ctypes.CDLL | None:
    """The loaded library, built first where needed; None where it cannot be had. Never raises; cached."""
    global _tried, _library
    if not _tried:
        with _lock:
            if not _tried:
                _library = _load()
                _tried = True
                if _library is None:  # asked for (RUNLM_NO_KERNELS) is no news; anything else is
                    level = logging.INFO if os.environ.get("RUNLM_NO_KERNELS") else logging.WARNING
                    logger.log(level, "runlm.native: kernels unavailable (%s)", why_unavailable)
    return _library
