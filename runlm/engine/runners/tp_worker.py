"""A tensor-parallel worker process (ranks 1..N-1; runlm.engine.runners.tp_group spawns it):
``python -m runlm.engine.runners.tp_worker RANK SIZE PORT < pickled EngineConfig``. It joins rank 0's group, loads
its part of the model and runs what rank 0 broadcasts: the torch runner's steps (tp_group.Worker) or the GPU
runner's (tp_gpu.GPUWorker)."""
from __future__ import annotations

import logging
import pickle
import sys

from runlm.engine.runners.gpu_select import use_gpu_runner
from runlm.engine.runners.threads import set_torch_threads
from runlm.engine.runners.tp_gpu import GPUWorker
from runlm.engine.runners.tp_group import Worker, agree, load_part, rank_device, rank_threads
from runlm.engine.types.config import EngineConfig
from runlm.models.tp_comm import Communicator, join_store

log = logging.getLogger("runlm.engine")


def worker_main(rank: int, size: int, port: int, config: EngineConfig) -> None:
    """A worker process: join, load its part, then run what rank 0 broadcasts until "stop"."""
    set_torch_threads(rank_threads(config))
    comm = Communicator(join_store(port, size), rank, size, rank_device(config, rank))
    part, error = None, None
    try:
        part = load_part(config, comm)
    except Exception as exc:
        error = exc
    if agree(comm, error):
        comm.close()
        return
    assert part is not None
    try:
        if use_gpu_runner(config):
            GPUWorker(*part, config, comm).serve()
        else:
            Worker(*part, config, comm).serve()
    except RuntimeError as exc:  # rank 0 went away (its engine ended without a "stop"): nothing is left to serve
        log.debug("tensor-parallel rank %d stops: %s", rank, exc)
    finally:
        comm.close()


if __name__ == "__main__":
    rank_, size_, port_ = map(int, sys.argv[1:4])
    worker_main(rank_, size_, port_, pickle.loads(sys.stdin.buffer.read()))
