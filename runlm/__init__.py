"""runlm: run language models locally and serve them."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "PoolingRequestOutput", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import runlm` (and the CLI's start-up) does not import torch.
    if name == "LLM":
        from runlm.engine.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from runlm.engine.async_llm import AsyncLLM
        return AsyncLLM
    if name == "SamplingParams":
        from runlm.engine.sampling_params import SamplingParams
        return SamplingParams
    if name in ("PoolingParams", "PoolingRequestOutput"):
        from runlm.engine import pooling_params
        return getattr(pooling_params, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from runlm.engine import request
        return getattr(request, name)
    raise AttributeError(f"module 'runlm' has no attribute {name!r}")
