"""AsyncLLM, as users import it: the in-process engine (runlm/engine/async_inproc.py) with its
data-parallel front end (runlm/engine/parallel/client.py) loaded, so ``AsyncLLM(model,
data_parallel_size=N)`` builds the front end over N replicas and any other call the in-process engine.
"""
from __future__ import annotations

from runlm.engine.async_inproc import AsyncLLM, EngineDeadError, RequestStream
from runlm.engine.parallel.client import DPAsyncLLM

__all__ = ["AsyncLLM", "DPAsyncLLM", "EngineDeadError", "RequestStream"]
