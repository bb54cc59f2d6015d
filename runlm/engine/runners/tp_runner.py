"""The tensor-parallel torch runner, rank 0's end (runlm.engine.runners.tp_group holds the group): the torch
runner over rank 0's part of the model, which before each step broadcasts the step's plan to the other ranks
and the hidden rows whose logits it will compute, so that every rank runs the same layers and collectives."""
from __future__ import annotations

from dataclasses import replace

from runlm.engine.core.batch_plan import plan_batch
from runlm.engine.core.kv_groups import AnyBlockManager
from runlm.engine.core.scheduler import SchedulerOutput
from runlm.engine.runners.torch_runner import ModelRunner, PreparedBatch
from runlm.engine.runners.tp_group import TPGroup, TPLoaded
from runlm.engine.sample.sampler import SampledToken
from runlm.engine.structured.backend import StructuredOutputManager
from runlm.engine.types.config import EngineConfig


class TPRunner(ModelRunner):
    def __init__(self, config: EngineConfig, loaded: TPLoaded, blocks: AnyBlockManager,
                 structured: StructuredOutputManager | None = None) -> None:
        assert loaded.group is not None and loaded.split is not None
        self.group: TPGroup = loaded.group
        self.local_kv_heads = loaded.split.local_kv_heads
        super().__init__(config, loaded, blocks, structured)

    def kv_cache_heads(self) -> int:
        return self.local_kv_heads

    def allocate_kv_cache(self) -> None:
        c, bs = self.loaded.config, self.blocks.block_size
        layer_slots = [self.blocks.layer_blocks(layer) * bs if layer in c.kv_layers else 0
                       for layer in range(c.num_layers)]
        self.group.send(("cache", layer_slots, self.blocks.state_slots))
        super().allocate_kv_cache()

    def free_kv_cache(self) -> None:
        self.group.send(("free",))
        super().free_kv_cache()

    def execute(self, sched: SchedulerOutput) -> list[SampledToken]:
        try:
            return super().execute(sched)
        except RuntimeError as exc:  # a collective failed: a worker is gone
            raise self.group.died(exc) from None

    def prepare(self, sched: SchedulerOutput) -> PreparedBatch:
        plan = plan_batch(sched, self.blocks)
        # the rows execute() computes logits of, in its order: each prompt-logprob span, then the sampled rows
        rows = [list(range(r.first_row, r.first_row + r.count)) for r in plan.prompt_logprob_rows]
        if plan.sample_seqs:
            rows.append(plan.sample_rows)
        self.group.send(("step", replace(plan, sample_seqs=[], spec_seqs=[], prompt_logprob_rows=[]), rows))
        return self.prepare_plan(plan, sched)

    def check_alive(self) -> None:
        self.group.check_alive()

    def close(self) -> None:
        self.group.close()
