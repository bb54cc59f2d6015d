"""The memory budget the loader keeps loaded models within."""
from __future__ import annotations

import os
from dataclasses import dataclass

from runlm.runner.backends.base import RequiredMemory
from runlm.sizes import gpu_memory

DEFAULT_RAM_FRACTION = 0.75


def total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


@dataclass(slots=True)
class MemoryBudget:
    ram: int
    vram: int | None = None  # None: not limited by the runner (no GPU, or the backend manages it)

    @classmethod
    def default(cls) -> MemoryBudget:
        """Three quarters of RAM; and the GPU's memory where there is one (the native backend reserves its
        --gpu-memory-utilization share of it per model on the GPU)."""
        gpu = gpu_memory()
        return cls(int(total_ram() * DEFAULT_RAM_FRACTION), gpu)

    def fits(self, used: RequiredMemory, extra: RequiredMemory) -> bool:
        return used.ram + extra.ram <= self.ram and (self.vram is None or used.vram + extra.vram <= self.vram)

    def can_ever_fit(self, need: RequiredMemory) -> bool:
        return self.fits(RequiredMemory(0, 0), need)


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
