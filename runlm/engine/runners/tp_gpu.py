"""Tensor parallelism on the GPU runner: each rank a GPU runner over its part of the model (runlm.models.tp_shard,
cut on the host and moved to the rank's own device), its collectives on NCCL (gloo on CPUs), its paged KV cache
of its own KV heads sized from its own device's memory (the ranks then agree on the least of them).

Rank 0 (the engine's process) schedules, packs each step into its host array (gpu_graphs.pack_step) and
broadcasts the array's bytes with what the forward pass needs (gpu.PackedStep) and the rows whose logits it will
compute; every rank then runs the same upload, the same forward pass (a decode graph replayed where rank 0
replays one: the graphs, captured on every rank in the same order, hold the all-reduces) and the same logits'
gather. Only rank 0 samples.

What it does not run (refused by name at start-up): LoRA adapters, speculative decoding, layer offload, and what
tensor parallelism itself does not split (tp_shard.why_not_tp).
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from runlm.engine.core.batch_plan import BatchPlan
from runlm.engine.core.kv_groups import AnyBlockManager
from runlm.engine.core.scheduler import SchedulerOutput
from runlm.engine.runners.gpu import GPURunner, PackedStep, gpu_kv_cache_blocks
from runlm.engine.runners.tp_group import TPGroup, TPLoaded, logit_rows, rank_device
from runlm.engine.sample.sampler import SampledToken
from runlm.engine.structured.backend import StructuredOutputManager
from runlm.engine.types.config import EngineConfig
from runlm.models.load import LoadedModel
from runlm.models.tp_comm import Communicator
from runlm.models.tp_shard import Split

log = logging.getLogger("runlm.engine")


def rank_kv_cache_blocks(config: EngineConfig, loaded: LoadedModel, split: Split, comm: Communicator,
                         bytes_per_token: int, max_model_len: int) -> int:
    """This rank's blocks (its own KV heads, profiled on its own device: every rank runs the profile's forward
    pass at once), then the least over the ranks."""
    kept = bytes_per_token * split.local_kv_heads * split.size // split.kv_heads
    blocks = gpu_kv_cache_blocks(config, loaded, kept, max_model_len, rank_device(config, comm.rank))
    return comm.min_int(blocks)


class GPUTPRunner(GPURunner):
    """Rank 0's GPU runner: before each step's forward pass, the step to the other ranks."""

    overlaps = False  # (a stand-in's draw is rank 0's alone: the other ranks would embed the stand-in)

    def __init__(self, config: EngineConfig, loaded: TPLoaded, blocks: AnyBlockManager,
                 structured: StructuredOutputManager | None = None) -> None:
        assert loaded.group is not None and loaded.split is not None
        self.group: TPGroup = loaded.group
        self.split: Split = loaded.split
        super().__init__(config, loaded, blocks, structured, kv_heads=loaded.split.local_kv_heads,
                         device=rank_device(config, 0))

    def allocate_kv_cache(self) -> None:
        # (every rank allocates and captures its graphs at once: a capture's warm-up joins the collectives)
        self.group.send(("cache", self.blocks))  # (the worker reads its shape: groups, block counts, state slots)
        super().allocate_kv_cache()

    def free_kv_cache(self) -> None:
        self.group.send(("free",))
        super().free_kv_cache()

    def share_step(self, step: PackedStep, plan: BatchPlan) -> None:
        self.group.send(("step", step, self.host_np[:step.layout.size].copy(), logit_rows(plan)))

    def execute(self, sched: SchedulerOutput) -> list[SampledToken]:
        try:
            return super().execute(sched)
        except RuntimeError as exc:  # a collective failed: a worker is gone
            raise self.group.died(exc) from None

    def check_alive(self) -> None:
        self.group.check_alive()

    def close(self) -> None:
        self.group.close()


class GPUWorker:
    """Ranks 1..N-1 on the GPU runner: what rank 0 broadcasts, run on this rank's part and device."""

    def __init__(self, loaded: LoadedModel, split: Split, config: EngineConfig, comm: Communicator) -> None:
        self.loaded, self.split, self.config, self.comm = loaded, split, config, comm
        self.device = rank_device(config, comm.rank)
        self.runner: GPURunner | None = None

    def serve(self) -> None:
        while True:
            op, *args = self.comm.broadcast_object()
            if op == "step":
                self.step(*args)
            elif op == "profile":
                rank_kv_cache_blocks(self.config, self.loaded, self.split, self.comm, *args)
            elif op == "cache":
                self.allocate(*args)
            elif op == "free":
                if self.runner is not None:
                    self.runner.free_kv_cache()
            elif op == "stop":
                return

    def allocate(self, blocks: AnyBlockManager) -> None:
        """The cache rank 0 allocated (the shape of its block manager), and the graphs over it."""
        if self.runner is not None:
            self.runner.allocate_kv_cache()
            return
        self.runner = GPURunner(self.config, self.loaded, blocks, kv_heads=self.split.local_kv_heads,
                                device=self.device)

    @torch.inference_mode()
    def step(self, step: PackedStep, packed: np.ndarray, rows: list[list[int]]) -> None:
        runner = self.runner
        assert runner is not None and runner.backend is not None, "a step before the cache"
        if runner.uploaded is not None:
            runner.uploaded.synchronize()
        runner.host_np[:len(packed)] = packed
        hidden = runner.forward_packed(step)
        model: Any = self.loaded.model
        for r in rows:
            model.compute_logits(hidden[torch.as_tensor(r, device=runner.device)])
