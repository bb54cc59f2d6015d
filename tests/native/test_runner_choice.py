"""Which runner computes, and why (issue 30): the engine's start-up line names the runner, and where it is not the
native one, the one reason that keeps it off (the first of the engine's, the file's or the vision tower's)."""
from __future__ import annotations

import logging

import pytest

from runlm.engine.llm import LLM
from runlm.native import kernels
from tests.fixtures.gguf_convert import converted_gguf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")

KW = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory="16MiB", max_model_len=256)


def _ready_line(caplog: pytest.LogCaptureFixture) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("recipe", ["llama", "gemma3", "qwen3-moe"])
def test_the_native_runner_is_named(recipe: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        llm = LLM(str(converted_gguf(recipe, "q8_0")), **KW)
    assert llm.engine.native
    assert "runner native;" in _ready_line(caplog)


def test_the_torch_runner_says_why(caplog: pytest.LogCaptureFixture) -> None:
    path = str(converted_gguf("llama", "q8_0"))
    with caplog.at_level(logging.INFO):
        llm = LLM(path, exact_numerics=True, **KW)
    assert not llm.engine.native
    assert "runner torch (exact numerics);" in _ready_line(caplog)
    caplog.clear()
    with caplog.at_level(logging.INFO):  # the file's own reason: fp32 matrices have no native kernel
        llm = LLM(str(converted_gguf("llama", "f32")), **KW)
    assert not llm.engine.native
    assert "runner torch (tensor " in _ready_line(caplog) and "of type F32)" in _ready_line(caplog)
