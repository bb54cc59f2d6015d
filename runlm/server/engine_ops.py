"""Operator routes over the engine (vLLM's): ``POST /scale_elastic_ep`` {new_data_parallel_size,
drain_timeout?}, ``POST /is_scaling_elastic_ep``, ``POST /start_profile``, ``POST /stop_profile`` and
``POST /reset_mm_cache``.

They change how the server runs (processes started and stopped, traces written to disk), so they sit
behind the API key when one is set. Scaling needs a data-parallel engine (``serve-engine
--data-parallel-size N``, or ``--distributed-executor-backend`` for one replica that can grow);
profiling needs ``--profiler-dir``.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse

from runlm.engine.parallel.client import DPAsyncLLM
from runlm.engine.parallel.replica import ReplicaDeadError
from runlm.engine.profiler import ProfilerError
from runlm.server.body import parse_body
from runlm.server.errors import APIError, bad_request
from runlm.server.state import ServerState
from runlm.web.openapi import json_body

router = APIRouter()

_MAX_REPLICAS = 256


class ScaleElasticEPRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    new_data_parallel_size: int = Field(ge=1, le=_MAX_REPLICAS)
    drain_timeout: float = Field(default=120.0, ge=0, le=3600)


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _dp_engine(request: Request) -> DPAsyncLLM:
    engine = _state(request).ready_engine()
    if not isinstance(engine, DPAsyncLLM):
        raise APIError(400, "this server runs one in-process engine; start it with --data-parallel-size N (or "
                            "--distributed-executor-backend mp) to scale it", code="data_parallel_not_enabled")
    return engine


@router.post("/scale_elastic_ep", openapi_extra=json_body(ScaleElasticEPRequest))
async def scale_elastic_ep(request: Request) -> JSONResponse:
    """Grow or shrink the data-parallel replicas; answers once the new size serves."""
    req = await parse_body(request, ScaleElasticEPRequest)
    engine = _dp_engine(request)
    state = _state(request)
    state.scaling = True
    try:
        await engine.scale_elastic_ep(req.new_data_parallel_size, req.drain_timeout)
    except ValueError as exc:
        raise bad_request(str(exc), "new_data_parallel_size") from None
    except (ReplicaDeadError, RuntimeError) as exc:
        raise APIError(500, f"scaling failed: {exc}", code="scaling_failed") from None
    finally:
        state.scaling = False
    return JSONResponse({"message": f"Scaled to {engine.data_parallel_size} data parallel engines",
                         "data_parallel_size": engine.data_parallel_size})


@router.post("/is_scaling_elastic_ep")
async def is_scaling_elastic_ep(request: Request) -> JSONResponse:
    return JSONResponse({"is_scaling_elastic_ep": _state(request).scaling})


@router.post("/start_profile")
async def start_profile(request: Request) -> JSONResponse:
    """Start a torch.profiler trace on every replica (written to --profiler-dir by /stop_profile)."""
    engine = _state(request).ready_engine()
    try:
        await engine.start_profile()
    except ProfilerError as exc:
        raise APIError(400, str(exc), code="profiler_error") from None
    return JSONResponse({"message": "profiling started"})


@router.post("/stop_profile")
async def stop_profile(request: Request) -> JSONResponse:
    """Stop the trace; the answer names the Chrome trace files written in --profiler-dir (one per replica)."""
    engine = _state(request).ready_engine()
    try:
        traces = await engine.stop_profile()
    except ProfilerError as exc:
        raise APIError(400, str(exc), code="profiler_error") from None
    return JSONResponse({"message": "profiling stopped", "traces": [Path(t).name for t in traces]})


@router.post("/reset_mm_cache")
async def reset_mm_cache(request: Request) -> JSONResponse:
    """Forget the images' embeddings (the engine's encoder cache; vLLM's route): the next request with an image
    runs the vision tower again."""
    await _state(request).ready_engine().reset_mm_cache()
    return JSONResponse({"message": "the multimodal cache is reset"})
