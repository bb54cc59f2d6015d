"""One rank's collectives in a tensor-parallel group, on torch.distributed's process groups: gloo on CPUs; on GPUs
NCCL for the tensors a step reduces and gathers (each rank's own device), gloo beside it for the step rank 0
broadcasts (pickled, host memory). Rank 0 (the engine's process) hosts the rendezvous (a TCPStore on a
free loopback port); the other ranks join it from the address it hands them.

A rank's process holds its group as an object (not torch.distributed's default group), so one process may host
several engines one after another, and nothing global is left behind when an engine goes.
"""
from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"  # the ranks are processes of one machine: nothing listens beyond it
JOIN_TIMEOUT = datetime.timedelta(seconds=120)  # every rank joins within this (a worker starts torch: seconds)
# a collective waits this long for the slowest rank (a long prefill on a CPU); a rank that dies fails it at once
STEP_TIMEOUT = datetime.timedelta(minutes=30)


def host_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous on a free loopback port (``store.port``): the address the other ranks join."""
    return dist.TCPStore(LOOPBACK, 0, size, True, timeout=JOIN_TIMEOUT, wait_for_workers=False)


def join_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(LOOPBACK, port, size, False, timeout=JOIN_TIMEOUT)


class Communicator:
    """all_reduce (row-parallel layers, the vocab-parallel embedding), gather (the vocab-parallel logits) and
    broadcast_object (rank 0's step to the others) over ``size`` ranks; ``calls`` counts the all-reduces."""

    def __init__(self, store: dist.TCPStore, rank: int, size: int, device: torch.device | None = None) -> None:
        self.rank, self.size, self.store = rank, size, store
        # (gloo's options with their devices: not in torch's type stubs)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]  # (not the host's public address)
        opts._timeout = STEP_TIMEOUT
        self.group: Any = dist.ProcessGroupGloo(store, rank, size, opts)
        self.tensors: Any = self.group  # the group the step's tensors go through (NCCL on a GPU)
        if device is not None and device.type == "cuda":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = STEP_TIMEOUT
            torch.cuda.set_device(device)
            self.tensors = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, nccl)
        self.all_reduces = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (t must be contiguous)."""
        self.all_reduces += 1
        self.tensors.allreduce([t]).wait()
        return t

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (each rank's KV cache from its own memory: the least of them)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self.group.allreduce([t], opts).wait()
        return int(t.item())

    def gather_cols(self, t: torch.Tensor, total: int) -> torch.Tensor:
        """Each rank's [N, cols] (equal cols, the last rank's padded) side by side on rank 0, cut to ``total``
        columns; the others get their own ``t`` back."""
        t = t.contiguous()
        if self.rank != 0:
            self.tensors.gather([], [t], _gather_options()).wait()
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.tensors.gather([parts], [t], _gather_options()).wait()
        return torch.cat(parts, dim=-1)[..., :total]

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled: what ranks exchange is the engine's own step, never input
        from outside the group)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.group.broadcast(size, 0).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.group.broadcast(data, 0).wait()
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def close(self) -> None:
        for group in {id(g): g for g in (self.tensors, self.group)}.values():
            try:
                group.shutdown()
            except RuntimeError:  # a peer already gone
                pass


def _gather_options() -> Any:
    opts = dist.GatherOptions()
    opts.rootRank = 0
    return opts
