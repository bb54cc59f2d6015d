"""runlm: run language models locally and serve them."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "PoolingRequestOutput", "LoRARequest", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import runlm` (and the CLI's start-up) does not import torch.
    if name == "LLM":
        from runlm.engine.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from runlm.engine.async_llm import AsyncLLM
        return AsyncLLM
    if name == "SamplingParams":
        from runlm.engine.types.sampling_params import SamplingParams
        return SamplingParams
    if name == "PoolingParams":
        from runlm.engine.types.pooling_params import PoolingParams
        return PoolingParams
    if name == "LoRARequest":
        from runlm.engine.types.lora_request import LoRARequest
        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput", "PoolingRequestOutput"):
        from runlm.engine.types import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'runlm' has no attribute {name!r}")
