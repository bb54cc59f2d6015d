from __future__ import annotations

import pytest

from runlm.engine.llm import LLM


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    """A tiny Qwen2 engine with a small block size, so tests cross block boundaries often."""
    return LLM(str(tiny_model("qwen2")), block_size=4, max_num_batched_tokens=64, kv_cache_memory="64MiB")


def prompt_ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]
