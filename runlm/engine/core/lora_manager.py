"""The engine's LoRA adapters: loading, the least-recently-used cache, pins, and which requests hold which.

* ``max_cpu_loras`` adapters stay loaded; loading one more evicts the least recently used one that
  is not pinned. An evicted (or removed) adapter that running requests still use stays attached
  until the last of them finishes, so removing an adapter never changes a request already running.
* Each load gets a fresh key: the forward pass's adapter index and the prefix cache's salt, so KV
  blocks computed under one adapter are never reused under another (nor under a reloaded one).
* ``max_loras`` (adapters in one step) is the scheduler's to enforce; ``max_lora_rank`` is checked here.
* The model is a torch model (adapters attach to its Linear layers, runlm.models.lora) or a NativeModel
  (adapters live in the native decoder, runlm.models.native_lora; the native runner passes each row's key).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runlm.engine.types.lora_request import LoRARequest
from runlm.formats import LoRAError
from runlm.models.config import ModelConfig
from runlm.models.native import NativeModel

if TYPE_CHECKING:  # the adapter code is torch's: imported where an adapter is enabled, loaded or run
    import torch

    from runlm.models.lora_weights import LoRAWeights

__all__ = ["LoRAError", "LoRAManager", "LoRARequest", "lora_salt"]


@dataclass(slots=True)
class LoadedLoRA:
    request: LoRARequest
    key: int
    weights: LoRAWeights  # kept to re-attach after the weights are reloaded (sleep level 2)
    users: int = 0        # sequences holding it
    listed: bool = True   # False once evicted or removed (then dropped when its last user finishes)


def lora_salt(key: int) -> bytes | None:
    """The prefix cache's first parent hash for sequences run with adapter ``key`` (None: the base model)."""
    return b"lora:%d" % key if key else None


class LoRAManager:
    def __init__(self, model: torch.nn.Module | NativeModel, cfg: ModelConfig, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None) -> None:
        self.model, self.cfg = model, cfg
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.loaded: OrderedDict[int, LoadedLoRA] = OrderedDict()  # lora_int_id -> adapter, least recent first
        self.pinned: set[int] = set()
        self.by_key: dict[int, LoadedLoRA] = {}  # every attached adapter, listed or not
        self._keys = itertools.count(1)
        _enable(model)

    # ---- the adapter set -------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> bool:
        """Load an adapter (False: that id is loaded already; it becomes the most recently used)."""
        if request.lora_int_id in self.loaded:
            self.loaded.move_to_end(request.lora_int_id)
            return False
        if not request.lora_path:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}) is not loaded and "
                            f"names no lora_path to load it from")
        from runlm.models.lora_weights import read_adapter

        weights = read_adapter(request.lora_path, self.cfg)
        if weights.rank > self.max_lora_rank:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} has rank {weights.rank}, above max_lora_rank "
                            f"{self.max_lora_rank} (raise --max-lora-rank)")
        self._make_room()
        key = next(self._keys)
        self.attach(key, weights)
        adapter = LoadedLoRA(request, key, weights)
        self.loaded[request.lora_int_id] = self.by_key[key] = adapter
        return True

    def _make_room(self) -> None:
        while len(self.loaded) >= self.max_cpu_loras:
            victim = next((i for i in self.loaded if i not in self.pinned), None)
            if victim is None:
                raise LoRAError(f"cannot load another LoRA adapter: all {self.max_cpu_loras} loaded adapters "
                                f"(max_cpu_loras) are pinned")
            self.remove(victim)

    def remove(self, lora_int_id: int) -> bool:
        adapter = self.loaded.pop(lora_int_id, None)
        if adapter is None:
            return False
        self.pinned.discard(lora_int_id)
        adapter.listed = False
        if adapter.users == 0:
            self._drop(adapter)
        return True

    def pin(self, lora_int_id: int) -> bool:
        """Never evict this adapter (until removed)."""
        if lora_int_id not in self.loaded:
            raise LoRAError(f"no LoRA adapter with id {lora_int_id} is loaded")
        self.pinned.add(lora_int_id)
        return True

    def ids(self) -> set[int]:
        return set(self.loaded)

    def _drop(self, adapter: LoadedLoRA) -> None:
        self.detach(adapter.key)
        self.by_key.pop(adapter.key, None)

    def attach(self, key: int, weights: LoRAWeights) -> None:
        """Attach an adapter's weights to the model under ``key``, checked first (all or nothing)."""
        _attach(self.model, key, weights, self.max_lora_rank)

    def detach(self, key: int) -> None:
        _detach(self.model, key)

    # ---- requests --------------------------------------------------------------------------------
    def acquire(self, request: LoRARequest | None, users: int = 1) -> int:
        """The key ``users`` new sequences run with (0: no adapter), loading the adapter when needed."""
        if request is None:
            return 0
        self.add(request)
        adapter = self.loaded[request.lora_int_id]
        adapter.users += users
        return adapter.key

    def release(self, key: int) -> None:
        """A sequence holding ``key`` finished."""
        adapter = self.by_key.get(key)
        if adapter is None:
            return
        adapter.users -= 1
        if adapter.users <= 0 and not adapter.listed:
            self._drop(adapter)

    def batch(self, keys: Iterable[int]) -> AbstractContextManager[None]:
        """The forward passes of a step whose sequences hold these keys."""
        keys = list(keys)
        if not any(keys) or isinstance(self.model, NativeModel):  # (the native runner passes the keys itself)
            return nullcontext()
        from runlm.models.lora import LoRABatch, lora_batch

        return lora_batch(LoRABatch(keys))

    def rebind(self, model: torch.nn.Module | NativeModel) -> None:
        """Attach every held adapter to a reloaded model."""
        self.model = model
        _enable(model)
        for adapter in self.by_key.values():
            self.attach(adapter.key, adapter.weights)


def _enable(model: torch.nn.Module | NativeModel) -> None:
    if not isinstance(model, NativeModel):  # (a native decoder takes adapters as they come)
        from runlm.models.lora import enable

        enable(model)


def _attach(model: torch.nn.Module | NativeModel, key: int, weights: LoRAWeights, max_rank: int | None = None) -> None:
    if isinstance(model, NativeModel):
        from runlm.models import native_lora

        native_lora.attach(model, key, weights, max_rank)
    else:
        from runlm.models.lora import attach

        attach(model, key, weights, max_rank)


def _detach(model: torch.nn.Module | NativeModel, key: int) -> None:
    if isinstance(model, NativeModel):
        from runlm.models import native_lora

        native_lora.detach(model, key)
    else:
        from runlm.models.lora import detach

        detach(model, key)
