"""Profiling (torch.profiler Chrome traces with the model's forward in them) and collective_rpc on the
in-process LLM and AsyncLLM."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from runlm.engine.async_llm import AsyncLLM
from runlm.engine.llm import LLM
from runlm.engine.profiler import PROFILER_DIR_ENV, ProfilerError
from runlm.engine.types.sampling_params import SamplingParams

SHORT = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _forward_spans(path: str) -> int:
    events = json.loads(Path(path).read_text())["traceEvents"]
    return sum(1 for e in events if str(e.get("name", "")).startswith("runlm::forward "))


def test_llm_profile_trace_holds_each_forward(llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROFILER_DIR_ENV, str(tmp_path))
    llm.start_profile()
    with pytest.raises(ProfilerError, match="already"):
        llm.start_profile()
    llm.generate(["hello"], SHORT, use_tqdm=False)
    [path] = llm.stop_profile()
    assert Path(path).parent == tmp_path and _forward_spans(path) >= 3  # one prefill + decodes
    llm.generate(["hello"], SHORT, use_tqdm=False)  # the hooks are gone: no span outside a profile
    with pytest.raises(ProfilerError, match="no profile"):
        llm.stop_profile()


def test_profiling_without_a_directory_says_how_to_set_one(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROFILER_DIR_ENV, raising=False)
    with pytest.raises(ProfilerError, match="profiler_dir"):
        llm.start_profile()


def test_llm_collective_rpc(llm: LLM) -> None:
    assert llm.collective_rpc("has_unfinished_requests") == [False]
    for bad in ("_drop", "no_such_method", "max_model_len"):
        with pytest.raises(ValueError):
            llm.collective_rpc(bad)


def test_async_llm_profiles_its_engine_thread(tiny_model, tmp_path: Path) -> None:
    engine = AsyncLLM(str(tiny_model("qwen2")), block_size=4, kv_cache_memory="64MiB", profiler_dir=str(tmp_path))

    async def main():
        await engine.start_profile()
        async for _ in engine.generate("hello", SHORT):
            pass
        paths = await engine.stop_profile()
        return paths, await engine.collective_rpc("has_unfinished_requests")
    try:
        (path,), rpc = asyncio.run(main())
    finally:
        engine.shutdown()
    assert _forward_spans(path) >= 3 and rpc == [False]
