"""A tensor-parallel group's processes: rank 0 is the engine's own process (it schedules, samples and drives);
ranks 1..N-1 are worker processes that each load the model, keep their part (runlm.models.tp_shard) and their
own KV cache, and run every step rank 0 broadcasts to them.

A step reaches a worker as rank 0's batch plan (runlm.engine.core.batch_plan: ids, positions, cache slots) and the
hidden rows whose logits rank 0 computes; the worker runs the same forward pass over its part of the weights and
joins the collectives (the layers' all-reduces, the logits' gather). A worker that dies fails rank 0's next
collective at once (gloo sees the closed connection), and the engine stops with a message naming the rank.
"""
from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from runlm.dtypes import torch_dtype
from runlm.engine.core.batch_plan import BatchPlan
from runlm.engine.runners.gpu_select import keep_gguf_blocks, use_gpu_runner
from runlm.engine.runners.torch_runner import KVCaches, States, allocate_caches, plan_context
from runlm.engine.sample.rejection import spec_rows
from runlm.engine.types.config import EngineConfig, physical_cores
from runlm.models import lora
from runlm.models.attention import forward_context
from runlm.models.load import LoadedModel, load_decoder
from runlm.models.spec import read_spec
from runlm.models.tp_comm import Communicator, host_store
from runlm.models.tp_shard import Split, shard_adapter, shard_model

log = logging.getLogger("runlm.engine")
WORKER_MODULE = "runlm.engine.runners.tp_worker"  # a worker process's main (it picks the torch or the GPU worker)
STOP_WAIT_S = 10.0  # how long a worker is given to leave after "stop" before it is terminated


@dataclass(slots=True)
class TPLoaded(LoadedModel):
    """Rank 0's part of the model, its group and its split."""
    group: TPGroup | None = None
    split: Split | None = None


class TPGroup:
    """Rank 0's end of the group: the communicator, this rank's split and the workers' processes."""

    def __init__(self, comm: Communicator, processes: list[subprocess.Popen]) -> None:
        self.comm, self.processes = comm, processes
        self._finalizer = weakref.finalize(self, _stop, comm, processes)

    @property
    def size(self) -> int:
        return self.comm.size

    def send(self, message: tuple[Any, ...]) -> None:
        """Broadcast an instruction to every worker (they run it as rank 0 does)."""
        self.check_alive()
        try:
            self.comm.broadcast_object(message)
        except RuntimeError as exc:
            raise self.died(exc) from None

    def died(self, exc: BaseException) -> RuntimeError:
        """The error a failed collective becomes: which ranks are gone, where that is known."""
        dead = self.dead_ranks()
        if dead:
            return RuntimeError(f"tensor-parallel {dead}; the engine cannot go on without it ({exc})")
        return RuntimeError(f"a tensor-parallel collective failed: {exc}")

    def dead_ranks(self) -> str:
        gone = [f"rank {rank} exited (code {p.returncode})" for rank, p in enumerate(self.processes, 1)
                if p.poll() is not None]
        return ", ".join(gone)

    def check_alive(self) -> None:
        dead = self.dead_ranks()
        if dead:
            raise RuntimeError(f"tensor-parallel {dead}; the engine cannot go on without it")

    def close(self) -> None:
        self._finalizer()


def _stop(comm: Communicator, processes: list[subprocess.Popen]) -> None:
    if all(p.poll() is None for p in processes):
        try:
            comm.broadcast_object(("stop",))
        except RuntimeError:
            pass
    for p in processes:
        try:
            p.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    comm.close()


def logit_rows(plan: BatchPlan) -> list[list[int]]:
    """The rows a runner computes logits of, in its order (each a gather every rank joins): each prompt-
    logprob span, then the sampled rows and the speculating sequences' rows."""
    rows = [list(range(r.first_row, r.first_row + r.count)) for r in plan.prompt_logprob_rows]
    sampled = plan.sample_rows + spec_rows(plan.spec_rows, plan.spec_seqs)
    if sampled:
        rows.append(sampled)
    return rows


def rank_threads(config: EngineConfig) -> int:
    """Each rank's share of the CPU threads (the ranks compute at once)."""
    return max(1, (config.threads or physical_cores()) // config.tensor_parallel_size)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``rank``'s device: on CUDA the rank-th GPU from the configured one (cuda:1 with 2 ranks: 1 and 2)."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def load_part(config: EngineConfig, comm: Communicator) -> tuple[LoadedModel, Split]:
    """This rank's part of the model: the whole as its runner loads it, then cut (tp_shard). The GPU runner's is
    read on the host and cut there; only the rank's part goes to its device."""
    spec = read_spec(config.model, config.mmproj)
    if not use_gpu_runner(config):
        loaded = load_decoder(spec, dtype=config.dtype, device=config.device, exact_numerics=config.exact_numerics)
        return loaded, shard_model(loaded.model, comm)
    from runlm.models.gpu_load import check_fits, held_bytes, load_to_device, move_to_device

    device = rank_device(config, comm.rank)
    loaded = load_to_device(spec, dtype=config.dtype, device="cpu", gguf_blocks=keep_gguf_blocks())
    split = shard_model(loaded.model, comm)
    check_fits(held_bytes(loaded.model), device, config.gpu_memory_utilization,
               f"{spec.path.name} (rank {comm.rank}'s part)")
    loaded.model = move_to_device(loaded.model, device)
    return loaded, split


def agree(comm: Communicator, error: BaseException | None) -> list[str]:
    """Every rank's load outcome, on every rank: the failed ranks' messages (from the store), in rank order."""
    if error is not None:
        comm.store.set(f"error/{comm.rank}", f"{type(error).__name__}: {error}")
    failures = comm.all_reduce(torch.tensor([0.0 if error is None else 1.0]))
    if not failures.item():
        return []
    keys = [f"error/{r}" for r in range(comm.size)]
    return [f"rank {r}: {comm.store.get(k).decode()}" for r, k in enumerate(keys) if comm.store.check([k])]


def start_group(config: EngineConfig) -> tuple[TPGroup, LoadedModel, Split]:
    """Spawn ranks 1..N-1, load rank 0's part beside them; raises ValueError with each failed rank's reason."""
    size = config.tensor_parallel_size
    store = host_store(size)
    processes = [spawn_worker(rank, size, store.port, config) for rank in range(1, size)]
    comm = Communicator(store, 0, size, rank_device(config, 0))  # (waits for every worker to join)
    group = TPGroup(comm, processes)
    part, error = None, None
    try:
        part = load_part(config, comm)
    except Exception as exc:  # every rank reports before any gives up
        error = exc
    failed = agree(comm, error)
    if failed:
        group.close()
        raise ValueError("tensor parallelism could not load the model: " + "; ".join(failed))
    assert part is not None
    return group, *part


def spawn_worker(rank: int, size: int, port: int, config: EngineConfig) -> subprocess.Popen:
    """Rank ``rank`` as a child process of this Python (a fresh interpreter: nothing of the caller's state or its
    main module is imported); its config arrives on its stdin."""
    p = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(rank), str(size), str(port)], stdin=subprocess.PIPE)
    assert p.stdin is not None
    p.stdin.write(pickle.dumps(config))
    p.stdin.close()
    return p


class Worker:
    def __init__(self, loaded: LoadedModel, split: Split, config: EngineConfig, comm: Communicator) -> None:
        self.loaded, self.split, self.config, self.comm = loaded, split, config, comm
        self.device = torch.device(config.device)
        self.kv_caches: KVCaches = []
        self.states: States = None
        self.layer_group: list[int] | None = None  # a cache in groups of layers (sliding-window layers')
        if config.enable_lora:
            lora.enable(loaded.model)

    def serve(self) -> None:
        while True:
            op, *args = self.comm.broadcast_object()
            if op == "step":
                self.step(*args)
            elif op == "cache":
                layer_slots, state_slots, self.layer_group = args
                self.kv_caches, self.states = allocate_caches(self.loaded.config, layer_slots, state_slots,
                                                              self.split.local_kv_heads, torch_dtype(self.config.dtype),
                                                              self.device)
            elif op == "free":
                self.kv_caches, self.states = [], None
            elif op == "lora_add":
                key, weights = args
                lora.attach(self.loaded.model, key, shard_adapter(weights, self.loaded.config, self.split))
            elif op == "lora_drop":
                lora.detach(self.loaded.model, args[0])
            elif op == "stop":
                return

    @torch.inference_mode()
    def step(self, plan: Any, logit_rows: list[list[int]], lora_keys: list[int]) -> None:
        ctx = plan_context(plan, self.kv_caches, self.states, self.layer_group, self.device)
        model = self.loaded.model
        with forward_context(ctx), lora.lora_batch(lora.LoRABatch(lora_keys)):
            hidden = model(torch.from_numpy(plan.ids).to(self.device), torch.from_numpy(plan.positions).to(self.device))
        for rows in logit_rows:
            model.compute_logits(hidden[rows])
