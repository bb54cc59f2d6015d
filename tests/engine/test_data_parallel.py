"""Data parallelism: AsyncLLM(data_parallel_size=2) over two real child processes (tiny Qwen2, one thread
each): routing and pinning, typed errors across the process boundary, fan-out of the control plane,
collective_rpc, profiling traces, elastic scaling, and a killed replica's requests and restart."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from runlm.engine.async_llm import AsyncLLM
from runlm.engine.parallel.client import DPAsyncLLM
from runlm.engine.parallel.replica import ReplicaDeadError
from runlm.engine.types.errors import SamplingParamsError
from runlm.engine.types.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids

SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)


@pytest.fixture(scope="module")
def dp(tiny_model, tmp_path_factory):
    llm = AsyncLLM(str(tiny_model("qwen2")), data_parallel_size=2, threads=2, block_size=4,
                   kv_cache_memory="64MiB", profiler_dir=str(tmp_path_factory.mktemp("traces")))
    yield llm
    llm.shutdown()


def run(coro):
    return asyncio.run(coro)


async def _finish(stream) -> list[int]:
    tokens: list[int] = []
    async for out in stream:
        tokens += out.outputs[0].token_ids
    return tokens


def test_the_front_end_stands_in_for_an_engine(dp: AsyncLLM) -> None:
    assert isinstance(dp, DPAsyncLLM) and sorted(dp.replicas) == [0, 1]
    pids = {r.pid for r in dp.replicas.values()}  # type: ignore[attr-defined]
    assert len(pids) == 2 and os.getpid() not in pids
    assert dp.tokenizer.encode("hello") and dp.max_model_len > 0 and "generate" in dp.get_supported_tasks()


def test_requests_spread_by_load_and_pin_by_rank(dp: DPAsyncLLM) -> None:
    async def main():
        streams = [await dp.add_request(f"spread{i}", {"prompt_token_ids": prompt_ids(12, seed=100 + i)}, SHORT)
                   for i in range(4)]
        ranks = [s.rank for s in streams]
        outs = await asyncio.gather(*(_finish(s) for s in streams))
        pinned = await dp.add_request("pinned", {"prompt_token_ids": prompt_ids(12, seed=1)}, SHORT,
                                      data_parallel_rank=1)
        return ranks, outs, pinned.rank, await _finish(pinned)
    ranks, outs, pinned_rank, pinned_out = run(main())
    assert sorted(ranks) == [0, 0, 1, 1]  # four requests at once: two each
    assert all(len(o) == 4 for o in outs) and pinned_rank == 1 and len(pinned_out) == 4
    with pytest.raises(ValueError, match="data_parallel_rank 7"):
        run(dp.add_request("nowhere", "hi", SHORT, data_parallel_rank=7))


def test_a_shared_prefix_goes_back_to_the_replica_that_caches_it(dp: DPAsyncLLM) -> None:
    prefix = prompt_ids(64, seed=7)

    async def main():
        first = await dp.add_request("p0", {"prompt_token_ids": prefix + [11, 12]}, SHORT)
        await _finish(first)
        followers = []
        for i in range(3):  # one at a time: the loads are equal, so only the prefix decides
            s = await dp.add_request(f"p{i + 1}", {"prompt_token_ids": prefix + [20 + i]}, SHORT)
            followers.append(s.rank)
            await _finish(s)
        return first.rank, followers
    home, followers = run(main())
    assert followers == [home] * 3


def test_greedy_output_matches_on_both_replicas(dp: DPAsyncLLM) -> None:
    prompt = {"prompt_token_ids": prompt_ids(10, seed=3)}

    async def main():
        return [await _finish(await dp.add_request(f"same{r}", prompt, SHORT, data_parallel_rank=r)) for r in (0, 1)]
    a, b = run(main())
    assert a == b and len(a) == 4


def test_typed_errors_cross_the_process_boundary(dp: DPAsyncLLM) -> None:
    with pytest.raises(SamplingParamsError) as err:
        run(dp.add_request("bad", "hi", SamplingParams(temperature=-1.0)))
    assert err.value.param == "temperature"
    assert "bad" not in dp._owner  # nothing left behind


def test_abort_ends_the_stream_on_its_replica(dp: DPAsyncLLM) -> None:
    async def main():
        stream = await dp.add_request("victim", {"prompt_token_ids": prompt_ids(10, seed=4)}, LONG)
        await stream.__anext__()
        await dp.abort("victim")
        outs = [o async for o in stream]
        return outs[-1]
    last = run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"


def test_sleep_and_pause_reach_every_replica(dp: DPAsyncLLM) -> None:
    async def on_each(method: str) -> list:
        return [await r.call(method) for _, r in sorted(dp.replicas.items())]

    async def main():
        await dp.sleep(1)
        sleeping = await on_each("is_sleeping")
        await dp.wake_up()
        awake = await on_each("is_sleeping")
        await dp.pause_generation(mode="wait")
        paused = await on_each("is_paused")
        held = asyncio.create_task(_add_and_finish(dp, "held", "hello"))
        await asyncio.sleep(0.3)
        still_held = not held.done()
        await dp.resume_generation()
        return sleeping, awake, paused, still_held, await held, await on_each("is_paused")
    sleeping, awake, paused, still_held, held_out, resumed = run(main())
    assert sleeping == [True, True] and awake == [False, False]
    assert paused == [True, True] and still_held and len(held_out) == 4 and resumed == [False, False]


def test_collective_rpc_runs_on_every_replica(dp: DPAsyncLLM) -> None:
    assert run(dp.collective_rpc("has_unfinished_requests")) == [False, False]
    with pytest.raises(ValueError, match="public engine method"):
        run(dp.collective_rpc("_run"))


@pytest.mark.slow  # kineto takes 10-20 s to start in each fresh process here; test_profile.py covers it in process
def test_profile_writes_one_trace_per_replica_with_the_forward_in_it(dp: DPAsyncLLM) -> None:
    async def main():
        await dp.start_profile()
        for r in (0, 1):
            await _finish(await dp.add_request(f"prof{r}", "profile me", SHORT, data_parallel_rank=r))
        return await dp.stop_profile()
    paths = run(main())
    assert len(paths) == 2 and {Path(p).name.split("-")[0] for p in paths} == {"replica0", "replica1"}
    for path in paths:
        names = {e.get("name", "") for e in json.loads(Path(path).read_text())["traceEvents"]}
        assert any(n.startswith("runlm::forward ") for n in names), path


def test_metrics_sum_the_replicas(dp: DPAsyncLLM) -> None:
    async def main():  # traffic of its own on both replicas (an earlier sleep may have reset the counters)
        for r in (0, 1):
            await _finish(await dp.add_request(f"metrics{r}", "count me", SHORT, data_parallel_rank=r))
    run(main())
    deadline = time.monotonic() + 10  # the children push their counters every _STATS_PERIOD
    while time.monotonic() < deadline and not all(s.prefix_cache_queries for _, s in dp.replica_stats()):
        time.sleep(0.1)
    per = dp.replica_stats()
    assert [rank for rank, _ in per] == [0, 1]
    assert all(s.prefix_cache_queries > 0 for _, s in per)
    assert dp.stats().prefix_cache_queries == sum(s.prefix_cache_queries for _, s in per)


@pytest.mark.slow
def test_scaling_down_and_up_loses_no_request(dp: DPAsyncLLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def traffic(tag: str, n: int) -> list[list[int]]:
        async def one(i: int) -> list[int]:
            return await _finish(await dp.add_request(f"{tag}{i}", {"prompt_token_ids": prompt_ids(8, seed=i)},
                                                      params))
        return list(await asyncio.gather(*(one(i) for i in range(n))))

    async def main():
        flowing = asyncio.create_task(traffic("down", 8))
        await asyncio.sleep(0.05)
        await dp.scale_elastic_ep(1)  # rank 1 drains: its requests finish, new ones go to rank 0
        size_after_down = dp.data_parallel_size
        assert dp.replicas[0].spec.engine_args["threads"] == 2  # the one replica left has both threads
        during = await traffic("one", 3)
        flowing2 = asyncio.create_task(traffic("up", 8))
        await dp.scale_elastic_ep(2)
        return size_after_down, await flowing, during, await flowing2, dp.data_parallel_size
    down, first, during, second, final = run(main())
    assert down == 1 and final == 2
    assert [r.spec.engine_args["threads"] for _, r in sorted(dp.replicas.items())] == [1, 1]
    assert all(len(t) == 24 for t in first + during + second)
    assert run(_finish_on(dp, 1)) == 4  # the new rank 1 serves


async def _add_and_finish(dp: DPAsyncLLM, rid: str, prompt: str) -> list[int]:
    return await _finish(await dp.add_request(rid, prompt, SHORT))


async def _finish_on(dp: DPAsyncLLM, rank: int) -> int:
    return len(await _finish(await dp.add_request(f"on{rank}-{time.monotonic()}", "hi", SHORT,
                                                  data_parallel_rank=rank)))


@pytest.mark.slow
def test_a_killed_replica_fails_or_retries_its_requests_and_is_restarted(dp: DPAsyncLLM) -> None:
    async def main():
        await dp.replicas[0].call("pause_generation", "abort")  # rank 0 takes requests but runs none
        long_ones = [await dp.add_request(f"long{i}", {"prompt_token_ids": prompt_ids(8, seed=i)}, LONG,
                                          data_parallel_rank=1) for i in range(2)]
        for s in long_ones:
            await s.__anext__()  # output was streamed: these cannot be retried
        waiting = asyncio.create_task(_add_and_finish(dp, "retried", "hello there"))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # held on the paused rank 0 (the least loaded)
        os.kill(dp.replicas[0].pid, signal.SIGKILL)  # type: ignore[attr-defined]
        retried = await asyncio.wait_for(waiting, 60)
        os.kill(dp.replicas[1].pid, signal.SIGKILL)  # type: ignore[attr-defined]
        errors = []
        for s in long_ones:
            with pytest.raises(ReplicaDeadError) as err:
                async for _ in s:
                    pass
            errors.append(str(err.value))
        return retried, errors
    retried, errors = run(main())
    assert len(retried) == 4
    assert all("died" in e and "lost after part of its output was streamed" in e for e in errors)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (dp._pool.restarts >= 2 and len(dp._pool.serving()) == 2):
        time.sleep(0.5)
    assert dp._pool.restarts >= 2 and len(dp._pool.serving()) == 2
    assert run(_finish_on(dp, 0)) == 4 and run(_finish_on(dp, 1)) == 4


def test_replicas_take_one_gpu_each_where_there_are_several(dp: DPAsyncLLM) -> None:
    """vLLM's placement on a machine with several GPUs: a bare "cuda" gives replica r cuda:(r % GPUs), a named
    device, one GPU, the CPU or Ray's actors (given GPUs of their own) keep the device as given; here (no GPU) the
    replicas keep the engine's own device."""
    from runlm.engine.parallel.pool import ReplicaPool, replica_devices

    assert replica_devices("cuda", "mp", 4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    for device, backend, gpus in [("cuda", "mp", 1), ("cuda:1", "mp", 4), ("cpu", "mp", 4), ("cuda", "ray", 4)]:
        assert replica_devices(device, backend, gpus) is None
    pool = ReplicaPool("m", {"device": "cuda"}, 8, make=print, prepare=print, on_gone=print,  # type: ignore[arg-type]
                       devices=["cuda:0", "cuda:1"])  # (specs only: nothing is started)
    assert [pool.spec(r, 3).engine_args["device"] for r in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert [pool.spec(r, 2).engine_args["threads"] for r in range(2)] == [4, 4]
    assert all("device" not in r.spec.engine_args or r.spec.engine_args["device"] == "cpu"
               for r in dp.replicas.values())
