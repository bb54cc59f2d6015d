"""What a Ray actor replica runs (runlm/engine/parallel/ray_actor.py), in this process and without Ray:
the engine's typed errors survive pickling as themselves, and a request's stream is ACCEPTED or the
engine's error first, then its outputs. (Ray itself: tests/ray, slow.)"""
from __future__ import annotations

import asyncio
import pickle

import pytest

from runlm.catalog import UnknownModelError
from runlm.engine.engine_core import EngineStats
from runlm.engine.parallel.ray_actor import ACCEPTED, EngineActor
from runlm.engine.parallel.replica import RemoteError
from runlm.engine.types.errors import PromptTooLongError, SamplingParamsError
from runlm.engine.types.sampling_params import SamplingParams


def roundtrip(exc: BaseException) -> BaseException:
    return pickle.loads(pickle.dumps(RemoteError.of(exc))).rebuild()


def test_typed_errors_come_back_as_themselves() -> None:
    err = roundtrip(SamplingParamsError("temperature", "must be between 0 and 2"))
    assert type(err) is SamplingParamsError and err.param == "temperature" and "between 0 and 2" in str(err)
    long = roundtrip(PromptTooLongError("too long", 9000, 2048))
    assert type(long) is PromptTooLongError and (long.num_tokens, long.max_model_len) == (9000, 2048)


def test_an_unpicklable_field_keeps_the_type_and_message() -> None:
    exc = ValueError("bad")
    exc.handle = lambda: None  # type: ignore[attr-defined]
    err = roundtrip(exc)
    assert type(err) is ValueError and str(err) == "bad"


def test_actor_streams_accepted_then_outputs_and_refuses_bad_input() -> None:
    actor = EngineActor("tinycoder", {"threads": 1, "max_model_len": 256})

    async def scenario() -> None:
        items = [item async for item in actor.generate("r1", "def f(x):", SamplingParams(temperature=0.0, max_tokens=4),
                                                         0, "delta", None)]
        assert items[0] == ACCEPTED and items[-1].finished and len(items) == 5
        bad = [item async for item in actor.generate("r2", "word " * 400, SamplingParams(), 0, "delta", None)]
        assert len(bad) == 1
        err = bad[0].rebuild()
        assert isinstance(err, PromptTooLongError) and err.max_model_len == 256 and err.num_tokens > 256
        assert isinstance(await actor.heartbeat(), EngineStats)
        refused = await actor.call("_run", (), {})
        assert isinstance(refused, RemoteError) and "public" in str(refused.rebuild())
        assert (await actor.call("get_supported_tasks", (), {})) == ("generate",)

    try:
        asyncio.run(scenario())
    finally:
        asyncio.run(actor.shutdown())


def test_a_model_that_does_not_load_is_reported_not_raised() -> None:
    actor = EngineActor("no-such-model", {})
    assert isinstance(actor.load_error, RemoteError)
    beat = asyncio.run(actor.heartbeat())
    assert isinstance(beat, RemoteError)
    with pytest.raises(UnknownModelError):
        raise beat.rebuild()
