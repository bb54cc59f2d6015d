"""The memory budget the loader keeps loaded models within: RAM, and each GPU's memory, on which it places a model
that needs one where it fits (Ollama's scheduler: the GPU with the most room)."""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, replace

from runlm.runner.backends.base import RequiredMemory
from runlm.sizes import gpu_memories

DEFAULT_RAM_FRACTION = 0.75


def total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


@dataclass(slots=True)
class MemoryBudget:
    ram: int
    gpus: tuple[int, ...] = ()  # each GPU's memory, the driver's order (empty: no GPU, VRAM not limited here)

    @classmethod
    def default(cls) -> MemoryBudget:
        """Three quarters of RAM; and each GPU's memory (the native backend reserves its --gpu-memory-utilization
        share of one GPU per model there). A daemon started with CUDA_VISIBLE_DEVICES sees one budget of the first
        GPU: the driver's indices are not the ones its children would see."""
        gpus = gpu_memories()
        restricted = os.environ.get("CUDA_VISIBLE_DEVICES") is not None
        return cls(int(total_ram() * DEFAULT_RAM_FRACTION), gpus[:1] if restricted else gpus)

    def place(self, loaded: Iterable[RequiredMemory], need: RequiredMemory) -> RequiredMemory | None:
        """``need`` beside what the ``loaded`` models hold: with its GPU chosen (the one with the most room that
        takes it) where it needs GPU memory and there are GPUs; None where RAM or every GPU is short now."""
        loaded = list(loaded)
        if sum(m.ram for m in loaded) + need.ram > self.ram:
            return None
        if not need.vram or not self.gpus:
            return need
        room = [total - sum(m.vram for m in loaded if (m.gpu or 0) == i) for i, total in enumerate(self.gpus)]
        best = max(range(len(room)), key=room.__getitem__)
        return replace(need, gpu=best) if need.vram <= room[best] else None

    def can_ever_fit(self, need: RequiredMemory) -> bool:
        return self.place((), need) is not None

    def describe(self) -> str:
        """The budget as an error message names it."""
        gpus = ", ".join(f"GPU {i} {human_size(g)}" for i, g in enumerate(self.gpus))
        return human_size(self.ram) + (f" of RAM and {gpus}" if gpus else "")


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
