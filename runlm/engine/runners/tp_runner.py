"""The tensor-parallel torch runner, rank 0's end (runlm.engine.runners.tp_group holds the group): the torch
runner over rank 0's part of the model, which before each step broadcasts the step's plan to the other ranks
and the hidden rows whose logits it will compute, so that every rank runs the same layers and collectives."""
from __future__ import annotations

from dataclasses import replace

import torch

from runlm.engine.core.batch_plan import plan_batch
from runlm.engine.core.kv_groups import AnyBlockManager
from runlm.engine.core.lora_manager import LoRAManager
from runlm.engine.core.scheduler import SchedulerOutput
from runlm.engine.runners.torch_runner import ModelRunner, PreparedBatch
from runlm.engine.runners.tp_group import TPGroup, TPLoaded, logit_rows
from runlm.engine.sample.sampler import SampledToken
from runlm.engine.structured.backend import StructuredOutputManager
from runlm.engine.types.config import EngineConfig
from runlm.models.config import ModelConfig
from runlm.models.lora_weights import LoRAWeights
from runlm.models.tp_shard import Split, shard_adapter


class TPLoRAManager(LoRAManager):
    """Every rank's adapters: rank 0 attaches its cut of an adapter first (so its checks fail before any worker
    is told), then each worker attaches its own cut of the same weights (runlm.models.tp_shard.shard_adapter)."""

    def __init__(self, group: TPGroup, split: Split, model: torch.nn.Module, cfg: ModelConfig, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int | None) -> None:
        self.group, self.split = group, split
        super().__init__(model, cfg, max_loras, max_lora_rank, max_cpu_loras)

    def attach(self, key: int, weights: LoRAWeights) -> None:
        super().attach(key, shard_adapter(weights, self.cfg, self.split))
        self.group.send(("lora_add", key, weights))

    def detach(self, key: int) -> None:
        super().detach(key)
        self.group.send(("lora_drop", key))


class TPRunner(ModelRunner):
    def __init__(self, config: EngineConfig, loaded: TPLoaded, blocks: AnyBlockManager,
                 structured: StructuredOutputManager | None = None) -> None:
        assert loaded.group is not None and loaded.split is not None
        self.group: TPGroup = loaded.group
        self.split: Split = loaded.split
        self.local_kv_heads = loaded.split.local_kv_heads
        super().__init__(config, loaded, blocks, structured)

    def kv_cache_heads(self) -> int:
        return self.local_kv_heads

    def allocate_kv_cache(self) -> None:
        self.group.send(("cache", self.layer_slots(), self.blocks.state_slots, self.layer_group))
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
        step = replace(plan, sample_seqs=[], spec_seqs=[], prompt_logprob_rows=[])
        self.group.send(("step", step, logit_rows(plan), [s.lora_key for s in sched.seqs]))
        return self.prepare_plan(plan, sched)

    def lora_manager(self, model: torch.nn.Module, cfg: ModelConfig, max_loras: int, max_lora_rank: int,
                     max_cpu_loras: int | None) -> TPLoRAManager:
        return TPLoRAManager(self.group, self.split, model, cfg, max_loras, max_lora_rank, max_cpu_loras)

    def check_alive(self) -> None:
        self.group.check_alive()

    def close(self) -> None:
        self.group.close()
