"""What this host offers runlm's compiled kernels, found without importing torch: the CPU's AVX2/FMA,
the libggml-python wheel's headers and libraries, and the compiler flags every kernel build shares
(runlm/kernels/build.py for the torch extensions, runlm/native/build.py for the torch-free library)."""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = cpu_flags()
    if flags is not None:
        return {"avx2", "fma"} <= flags
    torch = sys.modules.get("torch")  # not Linux: ask torch where it is loaded already (its AVX2 needs avx2 and fma)
    return torch is not None and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def vnni_cflags(flags: set[str] | None) -> list[str]:
    """The flags for the int8 dot-product instruction (vpdpbusd) where this CPU has it: AVX-512 VNNI with its
    256-bit forms, or AVX-VNNI. The kernels are built on the machine they run on (each set of flags its own
    build), so this is the run-time choice; the integer sums are exact, so every path gives the same bits.
    RUNLM_VNNI=0 in the environment keeps the AVX2 path (to compare the two on one machine)."""
    if not flags or os.environ.get("RUNLM_VNNI") == "0":  # RUNLM_VNNI=0: the AVX2 path on any CPU
        return []
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256"]
    if "avx_vnni" in flags:
        return ["-mavxvnni"]
    return []


# -ffp-contract=off and no -ffast-math: the compiler must keep the written order of every sum.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", *vnni_cflags(cpu_flags())]
# libgomp.so.1 resolves to the copy torch already loaded: the torch extensions run on its pool; the native library
# (its own workers, kernels/csrc/parallel.h) only asks it for the default thread count.
LDFLAGS = ["-fopenmp"]


@dataclass(frozen=True)
class Libggml:
    """The libggml-python wheel: ggml's headers and its prebuilt libggml-cpu / libggml-base."""
    include: Path
    lib: Path

    def cflags(self) -> list[str]:
        return [f"-I{self.include}", "-mf16c"]

    def ldflags(self) -> list[str]:
        return [f"-L{self.lib}", "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{self.lib}"]


def libggml() -> Libggml | None:
    """The wheel's folders, or None where libggml-python is not installed (or ships no headers)."""
    try:
        import libggml as package  # a data-only package: importing it loads nothing
    except ImportError:
        return None
    root = Path(package.__file__).parent
    if not (root / "include" / "ggml-cpu.h").is_file():
        return None
    return Libggml(root / "include", root / "lib64" if (root / "lib64").is_dir() else root / "lib")
