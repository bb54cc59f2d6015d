"""The native runner and the torch fast path on one model: the pair every native parity test compares."""
from __future__ import annotations

from typing import Any

import pytest

from runlm.engine.llm import LLM


def native_and_torch(path: str, **kw: Any) -> tuple[LLM, LLM]:
    """(native, torch fast path) engines on the model at ``path`` (``RUNLM_NATIVE_RUNNER=0`` forces the torch one). The
    native one keeps an fp32 KV cache, as the torch one does, so that their numbers can be compared to the bit."""
    native = LLM(path, **{"kv_cache_dtype": "fp32", **kw})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RUNLM_NATIVE_RUNNER", "0")
        fused = LLM(path, **kw)
    assert native.engine.native and not fused.engine.native
    return native, fused
