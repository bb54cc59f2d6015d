"""RayReplica on a real two-node Ray cluster: placement on both nodes, streaming, typed errors, a killed
actor restarted by Ray while the other replica keeps serving, growing and shrinking without losing a
request, and a replica Ray will not restart reported dead."""
from __future__ import annotations

import asyncio

import pytest

from runlm.catalog import UnknownModelError
from runlm.engine.engine_core import EngineStats
from runlm.engine.parallel.replica import ReplicaDeadError, ReplicaSpec
from runlm.engine.types.errors import PromptTooLongError
from runlm.engine.types.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'runlm[ray]' (make test-slow does)")

from runlm.engine.parallel.ray_replica import RayReplica  # noqa: E402  (needs Ray)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def replica(cluster, rank: int) -> RayReplica:
    # tinycoder: a built-in store name, resolved on whichever node the actor lands on
    return RayReplica(ReplicaSpec("tinycoder", {"threads": 1, "max_model_len": 512}, rank), cluster.address)


async def complete(rep: RayReplica, rid: str, params: SamplingParams = GREEDY) -> tuple[str, str | None]:
    text, reason = "", None
    async for out in await rep.add_request(rid, "def fibonacci(n):", params):
        text += out.outputs[0].text
        reason = out.outputs[0].finish_reason
    return text, reason


def test_replicas_on_both_nodes_serve_and_a_killed_actor_is_restarted(ray_cluster) -> None:
    async def scenario() -> None:
        reps = [replica(ray_cluster, 0), replica(ray_cluster, 1)]
        await asyncio.gather(*(r.start() for r in reps))
        try:
            # one CPU per node and one per replica: Ray's placement puts one replica on each node
            assert {r.where["node_id"] for r in reps} == ray_cluster.node_ids()
            (a, why_a), (b, _) = await asyncio.gather(complete(reps[0], "a"), complete(reps[1], "b"))
            assert a and a == b and why_a == "length"  # same model, same greedy answer on both nodes
            assert reps[0].info.get("max_model_len", 512) == 512  # what a front end stands in with
            for _ in range(100):  # the watcher's heartbeat brings the engine's counters
                if reps[1].last_stats is not None:
                    break
                await asyncio.sleep(0.1)
            assert isinstance(reps[1].last_stats, EngineStats)

            # the engine's typed errors come back as themselves, before any output
            with pytest.raises(PromptTooLongError) as err:
                await reps[0].add_request("long", "word " * 700, GREEDY)
            assert err.value.max_model_len == 512 and err.value.num_tokens > 512
            stats = await reps[0].call("stats")
            assert isinstance(stats, EngineStats) and stats.num_running == 0
            with pytest.raises(ValueError, match="public"):
                await reps[0].call("_run")

            # kill replica 0's actor mid-stream: its stream fails with ReplicaDeadError, replica 1 keeps
            # serving meanwhile, and Ray restarts the actor (a new process) that then serves again
            old_pid = reps[0].where["pid"]
            stream = await reps[0].add_request("doomed", "def fibonacci(n):", LONG)
            assert reps[0].load().running == 1
            first = await stream.__anext__()
            assert first.outputs[0].token_ids
            ray.kill(reps[0].actor, no_restart=False)
            with pytest.raises(ReplicaDeadError):
                async for _ in stream:
                    pass
            assert reps[0].load().running == 0
            during = asyncio.create_task(complete(reps[1], "during"))
            after = await complete(reps[0], "after")  # waits for the restarted actor
            assert after == (a, "length") and (await during) == (a, "length")
            assert reps[0].alive and (await reps[0].locate())["pid"] != old_pid

            # an actor Ray will not restart: requests fail with ReplicaDeadError and the replica reads dead
            ray.kill(reps[1].actor, no_restart=True)
            with pytest.raises(ReplicaDeadError):
                await complete(reps[1], "gone")
            for _ in range(100):
                if not reps[1].alive:
                    break
                await asyncio.sleep(0.1)
            assert not reps[1].alive
        finally:
            await asyncio.gather(*(r.shutdown() for r in reps))
        assert not any(r.alive for r in reps)
        with pytest.raises(ReplicaDeadError):
            await reps[0].add_request("late", "hi", GREEDY)

    asyncio.run(scenario())


def test_a_model_the_node_cannot_find_fails_start_with_the_reason(ray_cluster) -> None:
    rep = RayReplica(ReplicaSpec("no-such-model", {"threads": 1}, 0), ray_cluster.address)
    with pytest.raises(UnknownModelError, match="no-such-model"):
        asyncio.run(rep.start())
    assert not rep.alive


def test_growing_and_shrinking_loses_no_request(ray_cluster) -> None:
    """1 -> 2 -> 1 replicas, as a front end scales: a replica added while requests run takes new ones; the
    one removed is drained first (wait_for_requests_to_drain in the actor), so every request finishes.
    (The data-parallel front end over RayReplica: tests/ray/test_dp_ray.py.)"""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    started = {f"s{i}": asyncio.Event() for i in range(3)}

    async def run(rep: RayReplica, rid: str) -> tuple[int, str | None]:
        tokens, reason = 0, None
        async for out in await rep.add_request(rid, "def fibonacci(n):", params):
            tokens += len(out.outputs[0].token_ids)
            reason = out.outputs[0].finish_reason
            if rid in started:
                started[rid].set()
        return tokens, reason

    async def scenario() -> None:
        first = replica(ray_cluster, 0)
        await first.start()
        second = replica(ray_cluster, 1)
        try:
            running = [asyncio.create_task(run(first, f"r{i}")) for i in range(3)]
            await second.start()  # 1 -> 2 while the first replica is busy
            running += [asyncio.create_task(run(second, rid)) for rid in started]
            await asyncio.gather(*(e.wait() for e in started.values()))  # the second replica is streaming them
            await second.call("wait_for_requests_to_drain", timeout=120)  # 2 -> 1: drain, then remove
            await second.shutdown()
            running += [asyncio.create_task(run(first, f"t{i}")) for i in range(2)]
            assert await asyncio.gather(*running) == [(48, "length")] * 8
        finally:
            await asyncio.gather(first.shutdown(), second.shutdown())

    asyncio.run(scenario())
