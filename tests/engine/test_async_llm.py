"""AsyncLLM: streaming, abort, pause/resume, sleep/wake, health, and a responsive event loop."""
from __future__ import annotations

import asyncio
import time

import pytest

from runlm.engine.async_llm import AsyncLLM, EngineDeadError
from runlm.engine.types.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    llm = AsyncLLM(str(tiny_model("qwen2")), block_size=4, kv_cache_memory="64MiB")
    yield llm
    llm.shutdown()


def run(coro):
    return asyncio.run(coro)


async def _collect(llm: AsyncLLM, rid: str, params: SamplingParams, n_prompt: int = 10):
    text, tokens, outs = "", [], []
    async for out in llm.generate({"prompt_token_ids": prompt_ids(n_prompt, seed=1)}, params, request_id=rid):
        outs.append(out)
        text += out.outputs[0].text
        tokens += out.outputs[0].token_ids
    return text, tokens, outs


def test_stream_of_deltas_adds_up_to_the_offline_result(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    text, tokens, outs = run(_collect(engine, "s1", params))
    assert len(outs) == 20 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].finish_reason == "length"
    expected = engine.engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert text == expected and len(tokens) == 20


def test_abort_frees_blocks_at_once(engine: AsyncLLM) -> None:
    async def main():
        stream = engine.generate({"prompt_token_ids": prompt_ids(40, seed=2)}, LONG, request_id="victim")
        first = await stream.__anext__()
        assert engine.engine.blocks.usage > 0 and first.outputs[0].token_ids
        await engine.abort("victim")
        rest = [o async for o in stream]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert engine.engine.blocks.num_free_blocks == len(engine.engine.blocks.blocks)
        # a client that just stops reading (disconnects) aborts too
        stream2 = engine.generate({"prompt_token_ids": prompt_ids(40, seed=3)}, LONG, request_id="gone")
        await stream2.__anext__()
        await stream2.aclose()
        await engine.wait_for_requests_to_drain(timeout=5)
        assert not engine.engine.has_unfinished_requests()
    run(main())


def test_event_loop_stays_responsive_while_computing(engine: AsyncLLM) -> None:
    async def main():
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.005)

        t = asyncio.create_task(ticker())
        await asyncio.gather(*[_collect(engine, f"busy{i}", SamplingParams(max_tokens=60, ignore_eos=True), 200)
                               for i in range(4)])
        t.cancel()
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        assert len(ticks) > 20 and max(gaps) < 0.5
    run(main())


def test_pause_wait_abort_and_resume(engine: AsyncLLM) -> None:
    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        running = asyncio.create_task(_collect(engine, "inflight", params))
        await asyncio.sleep(0.05)
        await engine.pause_generation(mode="wait")
        assert running.done() and (await running)[2][-1].outputs[0].finish_reason == "length"
        assert await engine.is_paused()
        held = asyncio.create_task(_collect(engine, "held", params))
        await asyncio.sleep(0.2)
        assert not held.done() and not engine.engine.has_unfinished_requests()
        await engine.resume_generation()
        assert len((await held)[1]) == 30
        # abort mode ends in-flight requests
        victim = asyncio.create_task(_collect(engine, "paused-victim", LONG))
        await asyncio.sleep(0.1)
        await engine.pause_generation(mode="abort")
        assert (await victim)[2][-1].outputs[0].finish_reason == "abort"
        await engine.resume_generation()
    run(main())


def test_sleep_and_wake_up(engine: AsyncLLM) -> None:
    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        before = (await _collect(engine, "pre-sleep", params))[1]
        for level in (1, 2):
            await engine.sleep(level)
            assert await engine.is_sleeping() and not engine.engine.runner.kv_caches
            await engine.wake_up()
            assert not await engine.is_sleeping()
            assert (await _collect(engine, f"post-sleep{level}", params))[1] == before
    run(main())


def test_controls_and_errors(engine: AsyncLLM) -> None:
    async def main():
        await engine.check_health()
        await engine.reset_prefix_cache()
        assert engine.get_supported_tasks() == ("generate",)
        assert (await engine.get_tokenizer()).vocab_size > 1000
        with pytest.raises(Exception, match="context length"):
            await _collect(engine, "too-long", SamplingParams(max_tokens=5), n_prompt=engine.engine.max_model_len + 1)
        await engine.check_health()  # a bad request does not hurt the engine
    run(main())


def test_dead_engine_fails_requests_and_health(tiny_model) -> None:
    llm = AsyncLLM(str(tiny_model("qwen2")), kv_cache_memory="16MiB")

    def boom(*_a, **_k):
        raise RuntimeError("simulated device failure")

    async def main():
        llm.engine.runner.execute = boom
        with pytest.raises(EngineDeadError, match="simulated"):
            await _collect(llm, "doomed", SamplingParams(max_tokens=5))
        with pytest.raises(EngineDeadError):
            await llm.check_health()
    run(main())
    llm.shutdown()


def test_callers_that_stop_waiting_do_not_kill_the_engine(engine: AsyncLLM) -> None:
    """A caller cancelled while its command waits for the engine thread (a server's gather cancelling the
    other prompts of a refused request) leaves its future cancelled; the engine thread runs the command all
    the same and must not die setting a result nobody takes."""
    async def scenario() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        tasks = [asyncio.create_task(engine.add_request(f"cancelled-{i}", {"prompt_token_ids": prompt_ids(8, seed=i)},
                                                        params)) for i in range(16)]
        await asyncio.sleep(0)  # every add is queued for the engine thread
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.abort([f"cancelled-{i}" for i in range(16)])
        engine.check_health_now()
        text, tokens, _ = await _collect(engine, "after-cancel", params)
        assert len(tokens) == 4

    run(scenario())
