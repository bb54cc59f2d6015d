"""What both draft runners (draft_native, draft_torch) share: the runner they wrap owns the draft's K/V caches."""
from __future__ import annotations

from typing import Any


class DraftRunnerBase:
    runner: Any  # a NativeRunner or a ModelRunner over the target's (main group's) block manager

    @property
    def kv_caches(self) -> list:  # type: ignore[type-arg]
        return self.runner.kv_caches  # type: ignore[no-any-return]

    def allocate_kv_cache(self) -> None:
        self.runner.allocate_kv_cache()

    def free_kv_cache(self) -> None:
        self.runner.free_kv_cache()
