"""The draft model on the native runner (runlm.engine.spec_decode.draft): numpy K/V caches of its own over the
target's block tables, one native decoder call per draft step; no torch in the process."""
from __future__ import annotations

import numpy as np

from runlm.engine.core.batch_plan import BatchPlan
from runlm.engine.core.kv_cache import BlockManager
from runlm.engine.core.sequence import Sequence
from runlm.engine.runners.native import NativeRunner
from runlm.engine.spec_decode.draft_base import DraftRunnerBase
from runlm.engine.types.config import EngineConfig
from runlm.models.native import NativeLoaded


class NativeDraftRunner(DraftRunnerBase):
    def __init__(self, config: EngineConfig, loaded: NativeLoaded, blocks: BlockManager) -> None:
        self.loaded, self.blocks = loaded, blocks
        self.runner = NativeRunner(config, loaded, blocks)

    def rebind(self, loaded: object) -> None:
        """After the weights were loaded again: the new decoder gets the draft's caches."""
        self.runner.rebind()

    def last_logits(self, items: list[tuple[Sequence, list[int], int]]) -> np.ndarray:
        # the target runner's own forward over a plan of these chunks: the same RoPE rows, caches and kernels
        query_lens = [len(tokens) for _, tokens, _ in items]
        context_lens = [p + len(tokens) for _, tokens, p in items]
        ids = np.fromiter((t for _, tokens, _ in items for t in tokens), np.int64, sum(query_lens))
        positions = np.concatenate([np.arange(p, p + len(tokens), dtype=np.int64) for _, tokens, p in items])
        # the new tokens' slots are the tail of the context's: one lookup serves both
        context = [np.asarray(self.blocks.slots(s.table, 0, c), dtype=np.int64)
                   for (s, _, _), c in zip(items, context_lens)]
        slots = np.concatenate([c[c.shape[0] - q:] for c, q in zip(context, query_lens)])
        hidden = self.runner.run_model(BatchPlan(ids, positions, slots, context, query_lens, context_lens))
        return self.loaded.model.compute_logits(hidden[np.cumsum(query_lens) - 1])
