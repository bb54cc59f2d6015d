"""The draft model on the torch runner (runlm.engine.spec_decode.draft): a ModelRunner's K/V tensors over the
target's block tables, where the draft cannot run natively (a safetensors model, exact numerics...)."""
from __future__ import annotations

import numpy as np
import torch

from runlm.engine.core.kv_cache import BlockManager
from runlm.engine.core.sequence import Sequence
from runlm.engine.runners.torch_runner import ModelRunner, PreparedBatch
from runlm.engine.spec_decode.draft_base import DraftRunnerBase
from runlm.engine.types.config import EngineConfig
from runlm.models.attention import ForwardContext
from runlm.models.load import LoadedModel


class TorchDraftRunner(DraftRunnerBase):
    def __init__(self, config: EngineConfig, loaded: LoadedModel, blocks: BlockManager) -> None:
        self.loaded, self.blocks = loaded, blocks
        self.runner = ModelRunner(config, loaded, blocks)

    def rebind(self, loaded: object) -> None:
        """The model object is read through ``loaded`` at each call: nothing to point again."""

    @torch.inference_mode()
    def last_logits(self, items: list[tuple[Sequence, list[int], int]]) -> np.ndarray:
        device = self.runner.device
        ids = [t for _, tokens, _ in items for t in tokens]
        positions = torch.cat([torch.arange(p, p + len(tokens)) for _, tokens, p in items])
        query_lens = [len(tokens) for _, tokens, _ in items]
        context_lens = [p + len(tokens) for _, tokens, p in items]
        slots = np.concatenate([self.blocks.slots(s.table, p, p + len(tokens)) for s, tokens, p in items])
        context = [self.runner.slot_tensor(self.blocks.slots(s.table, 0, c))
                   for (s, _, _), c in zip(items, context_lens)]
        ctx = ForwardContext(query_lens, context_lens, self.runner.slot_tensor(slots), context, self.runner.kv_caches)
        batch = PreparedBatch(torch.tensor(ids, device=device), positions.to(device), ctx)
        hidden = self.runner.run_model(batch)
        last = (torch.tensor(query_lens).cumsum(0) - 1).tolist()
        return self.loaded.model.compute_logits(hidden[last]).float().cpu().numpy()
