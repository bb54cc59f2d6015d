"""The data-parallel front end (AsyncLLM with data_parallel_size / distributed_executor_backend="ray")
over RayReplica actors on a real two-node Ray cluster: scaling 1 -> 2 -> 1 while requests run loses none."""
from __future__ import annotations

import asyncio

import pytest

from runlm.engine.types.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason="Ray is not installed: pip install 'runlm[ray]' (make test-slow does)")
pytest.importorskip("runlm.engine.parallel.client", reason="needs the data-parallel front end (runlm/engine/parallel/client.py)")

from runlm.engine.async_llm import AsyncLLM  # noqa: E402

PARAMS = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def test_front_end_on_ray_scales_1_2_1_without_losing_a_request(ray_cluster) -> None:
    llm = AsyncLLM("tinycoder", data_parallel_size=1, distributed_executor_backend="ray",
                   ray_address=ray_cluster.address, threads=1, max_model_len=512)

    async def one(i: int) -> tuple[str, str | None]:
        text, reason = "", None
        async for out in llm.generate("def fibonacci(n):", PARAMS, request_id=f"r{i}"):
            text += out.outputs[0].text
            reason = out.outputs[0].finish_reason
        return text, reason

    async def scenario() -> None:
        running = [asyncio.create_task(one(i)) for i in range(4)]
        await llm.scale_elastic_ep(2)  # 1 -> 2 while the first replica is busy
        nodes = {r.where["node_id"] for r in llm.replicas.values()}
        assert nodes == ray_cluster.node_ids()  # one replica on each node
        running += [asyncio.create_task(one(i)) for i in range(4, 10)]
        await asyncio.sleep(0.5)
        await llm.scale_elastic_ep(1)  # 2 -> 1: the removed replica is drained first
        running += [asyncio.create_task(one(i)) for i in range(10, 12)]
        results = await asyncio.gather(*running)
        assert [reason for _, reason in results] == ["length"] * 12
        assert len({text for text, _ in results}) == 1
        assert len(llm.replicas) == 1

    try:
        asyncio.run(scenario())
    finally:
        llm.shutdown()


def test_front_end_on_ray_keeps_serving_when_ray_restarts_a_killed_actor(ray_cluster) -> None:
    import ray

    from runlm.engine.parallel.replica import ReplicaDeadError

    llm = AsyncLLM("tinycoder", data_parallel_size=2, distributed_executor_backend="ray",
                   ray_address=ray_cluster.address, threads=2, max_model_len=512)
    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    started = [asyncio.Event() for _ in range(4)]

    async def one(i: int, params: SamplingParams = PARAMS, rank: int | None = None) -> str | None:
        reason = None
        async for out in llm.generate("def fibonacci(n):", params, request_id=f"k{i}", data_parallel_rank=rank):
            reason = out.outputs[0].finish_reason
            if i < len(started):
                started[i].set()
        return reason

    async def scenario() -> None:
        victim = llm.replicas[0]
        old_pid = victim.where["pid"]
        streaming = [asyncio.create_task(one(i, long, rank=i % 2)) for i in range(4)]  # two on each replica
        await asyncio.gather(*(e.wait() for e in started))
        ray.kill(victim.actor, no_restart=False)
        outcomes = await asyncio.gather(*streaming, return_exceptions=True)
        # what the killed actor held had streamed, so it fails clearly; the other replica's requests finish
        assert isinstance(outcomes[0], ReplicaDeadError) and isinstance(outcomes[2], ReplicaDeadError), outcomes
        assert outcomes[1] == outcomes[3] == "length"
        # Ray restarts the actor (a new process) and it serves again, pinned and routed requests alike
        assert await one(10, rank=0) == "length"
        assert await asyncio.gather(*(one(i) for i in range(11, 15))) == ["length"] * 4
        assert victim.alive and llm.replicas[0] is victim
        assert (await victim.locate())["pid"] != old_pid

    try:
        asyncio.run(scenario())
    finally:
        llm.shutdown()
