"""The draft model on the native runner (runlm.engine.spec_decode.draft): numpy K/V caches of its own over the
target's block tables, one native decoder call per draft step; no torch in the process."""
from __future__ import annotations

import numpy as np

from runlm.engine.core.kv_cache import BlockManager
from runlm.engine.core.sequence import Sequence
from runlm.engine.runners.native import NativeRunner
from runlm.engine.types.config import EngineConfig
from runlm.models.native import NativeLoaded


class NativeDraftRunner:
    def __init__(self, config: EngineConfig, loaded: NativeLoaded, blocks: BlockManager) -> None:
        self.loaded, self.blocks = loaded, blocks
        self.runner = NativeRunner(config, loaded, blocks)

    @property
    def kv_caches(self) -> list:  # type: ignore[type-arg]
        return self.runner.kv_caches

    def allocate_kv_cache(self) -> None:
        self.runner.allocate_kv_cache()

    def free_kv_cache(self) -> None:
        self.runner.free_kv_cache()

    def rebind(self, loaded: object) -> None:
        """After the weights were loaded again: the new decoder gets the draft's caches."""
        self.runner.rebind()

    def last_logits(self, items: list[tuple[Sequence, list[int], int]]) -> np.ndarray:
        decoder, model = self.loaded.model.decoder, self.loaded.model
        assert decoder is not None, "the draft's weights were released (sleep level 2)"
        query_lens = np.fromiter((len(tokens) for _, tokens, _ in items), np.int64, len(items))
        context_lens = np.fromiter((p + len(tokens) for _, tokens, p in items), np.int64, len(items))
        ids = np.fromiter((t for _, tokens, _ in items for t in tokens), np.int64, int(query_lens.sum()))
        positions = np.concatenate([np.arange(p, p + len(tokens), dtype=np.int64) for _, tokens, p in items])
        # the new tokens' slots are the tail of the context's: one lookup serves both
        context = [np.asarray(self.blocks.slots(s.table, 0, int(c)), dtype=np.int64)
                   for (s, _, _), c in zip(items, context_lens)]
        slots = np.concatenate([c[c.shape[0] - int(q):] for c, q in zip(context, query_lens)])
        flat = np.concatenate(context) if len(context) > 1 else context[0]
        hidden = decoder.forward(ids, positions, slots, query_lens, context_lens, flat,
                                 np.empty((ids.shape[0], decoder.hidden), dtype=np.float32))
        return model.compute_logits(hidden[np.cumsum(query_lens) - 1])
