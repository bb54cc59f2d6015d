"""The backend server's worker: requests take turns on one thread, and a cancelled one stops at its next step."""
from __future__ import annotations

import asyncio

from runlm.image_generation.pipeline import GenerationCancelled, ImageGenerator
from runlm.image_generation.request import parse_request
from runlm.image_generation.server import ImageServer, Job


def test_a_cancelled_request_stops_at_the_next_step_and_frees_the_worker(generator: ImageGenerator) -> None:
    state = ImageServer("tiny", generator=generator)
    long = generator.resolve(parse_request({"prompt": "x", "size": "16x16", "steps": 200, "seed": 1}))
    short = generator.resolve(parse_request({"prompt": "x", "size": "16x16", "steps": 2, "seed": 1}))
    steps: list[int] = []

    async def scenario() -> tuple[list, list]:
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        def on_step(k: int, n: int) -> None:
            steps.append(k)
            loop.call_soon_threadsafe(started.set)

        first = Job(state, long, on_step)
        task = asyncio.ensure_future(first.run(generator))
        await started.wait()
        task.cancel()  # what a client's disconnect does
        images = await Job(state, short).run(generator)  # queued behind the cancelled one on the one worker
        leftover = Job(state, short)
        leftover.cancel.set()  # cancelled before its turn: it never starts
        try:
            await leftover.run(generator)
        except GenerationCancelled:
            return images, ["not run"]
        return images, []

    images, skipped = asyncio.run(scenario())
    assert len(images) == 1 and skipped == ["not run"]
    assert 1 <= len(steps) < 200  # the long one stopped early
    state.worker.shutdown()
