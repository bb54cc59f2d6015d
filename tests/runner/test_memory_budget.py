"""The daemon's memory budget (runlm/runner/memory.py) with several GPUs: a model that needs GPU memory is placed on
the GPU with the most room that takes it (Ollama's scheduler), RAM-only models on none; what fits nowhere now waits
or evicts (the loader), what can never fit is refused with the sizes named; the placed backend's process sees only
its GPU. (The driver is asked for the GPUs' memory; these budgets are built with their sizes, as a machine with two
or three GPUs would report them.)"""
from __future__ import annotations

import os

from runlm.runner.backends.base import RequiredMemory
from runlm.runner.backends.native import NativeBackend
from runlm.runner.memory import MemoryBudget

GiB = 1 << 30


def test_a_model_goes_to_the_gpu_with_the_most_room() -> None:
    budget = MemoryBudget(64 * GiB, (80 * GiB, 24 * GiB))
    first = budget.place([], RequiredMemory(GiB, 20 * GiB))
    assert first == RequiredMemory(GiB, 20 * GiB, gpu=0)
    big_on_0 = RequiredMemory(GiB, 70 * GiB, gpu=0)
    assert budget.place([big_on_0], RequiredMemory(GiB, 20 * GiB)) == RequiredMemory(GiB, 20 * GiB, gpu=1)
    assert budget.place([big_on_0], RequiredMemory(GiB, 30 * GiB)) is None  # (10 and 24 GiB left: it waits)
    assert budget.can_ever_fit(RequiredMemory(GiB, 30 * GiB))
    assert not budget.can_ever_fit(RequiredMemory(GiB, 81 * GiB))


def test_ram_only_models_take_no_gpu_and_ram_still_counts() -> None:
    budget = MemoryBudget(16 * GiB, (24 * GiB,))
    assert budget.place([], RequiredMemory(4 * GiB, 0)) == RequiredMemory(4 * GiB, 0)
    assert budget.place([RequiredMemory(14 * GiB, 0)], RequiredMemory(4 * GiB, 2 * GiB)) is None
    assert MemoryBudget(16 * GiB).place([], RequiredMemory(GiB, 500 * GiB)) == RequiredMemory(GiB, 500 * GiB)
    assert MemoryBudget(16 * GiB, (80 * GiB, 24 * GiB)).describe() == "16.0 GiB of RAM and GPU 0 80.0 GiB, GPU 1 24.0 GiB"


def test_three_models_spread_over_three_gpus() -> None:
    budget = MemoryBudget(64 * GiB, (24 * GiB,) * 3)
    loaded: list[RequiredMemory] = []
    for _ in range(3):
        placed = budget.place(loaded, RequiredMemory(GiB, 20 * GiB))
        assert placed is not None
        loaded.append(placed)
    assert sorted(m.gpu for m in loaded) == [0, 1, 2]  # type: ignore[type-var]
    assert budget.place(loaded, RequiredMemory(GiB, 20 * GiB)) is None


def test_the_placed_backend_process_sees_its_gpu_alone(tmp_path) -> None:
    backend = NativeBackend(tmp_path)
    env = backend.child_env("sock", gpu=1)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert backend.child_env("sock").get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")  # (unplaced)
