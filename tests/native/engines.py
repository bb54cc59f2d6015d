"""The native runner and the torch fast path on one model: the pair every native parity test compares."""
from __future__ import annotations

from typing import Any

import pytest

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams

# a small cache over short prompts: what the KV cache dtype tests run
KV_KW: dict[str, Any] = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory="8MiB", max_model_len=512)
KV_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village, there lived"]


def greedy(llm: LLM, prompts: list[str], n: int = 16) -> list[list[int]]:
    """Each prompt's greedy tokens (with top-2 logprobs computed, as a client asking for them would)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def native_and_torch(path: str, **kw: Any) -> tuple[LLM, LLM]:
    """(native, torch fast path) engines on the model at ``path`` (``RUNLM_NATIVE_RUNNER=0`` forces the torch one). The
    native one keeps an fp32 KV cache, as the torch one does, so that their numbers can be compared to the bit."""
    native = LLM(path, **{"kv_cache_dtype": "fp32", **kw})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RUNLM_NATIVE_RUNNER", "0")
        fused = LLM(path, **kw)
    assert native.engine.native and not fused.engine.native
    return native, fused
