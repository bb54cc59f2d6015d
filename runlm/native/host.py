"""What this host offers runlm's compiled kernels, found without importing torch: the CPU's AVX2/FMA,
the libggml-python wheel's headers and libraries, and the compiler flags every kernel build shares
(runlm/kernels/build.py for the torch extensions, runlm/native/build.py for the torch-free library)."""
from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from pathlib import Path

# -ffp-contract=off and no -ffast-math: the compiler must keep the written order of every sum.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
# libgomp.so.1 resolves to the copy torch already loaded, so both share one OpenMP pool.
LDFLAGS = ["-fopenmp"]


def cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags: set[str] = set()
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
        return {"avx2", "fma"} <= flags
    except OSError:  # not Linux: ask torch where it is loaded already (its AVX2 level needs avx2 and fma)
        torch = sys.modules.get("torch")
        return torch is not None and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


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
