"""Sizes as people write them ('512MiB', '2g') and the memory the OS can still give; torch-free, so the
daemon, the CLI and the engine share them."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import re
import shutil
import subprocess
from pathlib import Path

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(value: int | float | str) -> int:
    """'512MiB', '2g', 1_000_000 -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 512MiB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def available_memory() -> int:
    """Bytes the OS can still give us (MemAvailable), or a conservative guess."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def return_free_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing).

    Loading a model builds and drops large temporaries (the vocabulary as Python strings, the tokenizer's
    JSON): freed, they stay in malloc's arenas and count in RSS for the process's whole life (~20-40 MB for
    a 150k-token vocabulary) unless trimmed."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def gpu_memory() -> int | None:
    """Total memory of the first NVIDIA GPU in bytes, or None without one."""
    memories = gpu_memories()
    return memories[0] if memories else None


@functools.lru_cache(maxsize=1)
def gpu_memories() -> tuple[int, ...]:
    """Each NVIDIA GPU's total memory in bytes, in the driver's order (empty without one) -- asked of the driver
    (its /proc entry, then nvidia-smi), never of torch, so a CPU process that asks stays torch-free."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if not gpus.is_dir() or not any(gpus.iterdir()):
        return ()
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        return tuple(int(line) << 20 for line in out.split())  # MiB
    except (OSError, subprocess.SubprocessError, ValueError):
        return ()


def read_small_text(path: str, limit: int, flag: str) -> str:
    """The UTF-8 text of the file a command-line ``flag`` names, at most ``limit`` bytes; a ValueError names the
    flag, the file and what is wrong."""
    file = Path(path).expanduser()
    try:
        if file.stat().st_size > limit:
            raise ValueError(f"{flag} {path}: larger than {limit} bytes")
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: cannot be read ({exc})") from None
