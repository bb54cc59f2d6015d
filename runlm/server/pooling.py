"""Embeddings, rerank and score: ``/v1/embeddings`` (OpenAI), ``/v1/rerank`` and ``/rerank`` (vLLM,
llama.cpp, Jina/Cohere shape), ``/v1/score`` and ``/score`` (vLLM).

Every input is its own engine request through ``AsyncLLM.encode``, so the engine's scheduler
batches the inputs of one HTTP request with those of every other in flight. Scores come from a
cross-encoder where the model is one, else from the cosine similarity of embeddings.
"""
from __future__ import annotations

import asyncio
import base64
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from runlm.engine.async_inproc import AsyncLLM
from runlm.engine.scoring import ScoreInputError, score_pairs
from runlm.engine.types.errors import PromptError
from runlm.engine.types.outputs import PoolingRequestOutput
from runlm.engine.types.pooling_params import PoolingParams, PoolingParamsError
from runlm.server.body import parse_body
from runlm.server.errors import APIError, bad_request
from runlm.server.generation import admit, engine_error, new_id
from runlm.server.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from runlm.server.state import ServerState
from runlm.web.openapi import json_body

if TYPE_CHECKING:  # the vectors are torch's (a pooling model ran); the server imports no torch for them itself
    import torch

router = APIRouter()


def pooling_error(exc: BaseException) -> APIError:
    if isinstance(exc, PoolingParamsError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, (PromptError, ScoreInputError)):
        return bad_request(str(exc), "input")
    return engine_error(exc, "input")


async def pool_all(state: ServerState, engine: AsyncLLM, prompts: list[Any], params: PoolingParams,
                   prefix: str) -> list[PoolingRequestOutput]:
    """Run every prompt as its own engine request, concurrently; all succeed or the request fails."""
    ticket = admit(state, engine, len(prompts))
    request_id = new_id(prefix)

    async def one(i: int, prompt: Any) -> PoolingRequestOutput:
        async for out in engine.encode(prompt, params, request_id=f"{request_id}-{i}"):
            if out.aborted:
                raise APIError(503, "the request was aborted (the server is pausing)", code="aborted")
            return out
        raise APIError(500, "the engine ended the request without a result", code="internal_error")

    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*tasks))
    except Exception as exc:
        raise pooling_error(exc) from None
    finally:
        for task in tasks:  # on failure or disconnect: abort the rest and free their places
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ticket.release()


def _check_count(state: ServerState, n: int, what: str) -> None:
    limit = state.settings.max_prompts_per_request
    if n > limit:
        raise bad_request(f"{what} has {n} entries; at most {limit} per request", what)


def _embedding_inputs(state: ServerState, value: Any) -> list[str | list[int]]:
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        value = [value]
    if not value:
        raise bad_request("input must not be empty", "input")
    _check_count(state, len(value), "input")
    for i, item in enumerate(value):
        if len(item) == 0:
            raise bad_request(f"input[{i}] is empty", "input")
    return list(value)


def _vector(data: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: little-endian float32 bytes, base64
        import torch

        return base64.b64encode(data.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()


def _usage(outs: list[PoolingRequestOutput]) -> dict[str, int]:
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": tokens, "total_tokens": tokens,
            "truncated_inputs": sum(1 for o in outs if o.num_truncated_tokens),
            "truncated_tokens": sum(o.num_truncated_tokens for o in outs)}


@router.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest))
async def embeddings(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    req = await parse_body(request, EmbeddingRequest)
    state.check_model(req.model)
    engine = state.require_task("embed", "embeddings")
    inputs = _embedding_inputs(state, req.input)
    try:
        # an input longer than the model takes is refused unless truncation is asked for (OpenAI, vLLM)
        params = PoolingParams("embed", req.normalize, req.dimensions, req.truncate_prompt_tokens, truncate=False)
    except PoolingParamsError as exc:
        raise pooling_error(exc) from None
    outs = await pool_all(state, engine, inputs, params, "embd")
    data = [{"object": "embedding", "index": i, "embedding": _vector(o.outputs.data, req.encoding_format)}
            for i, o in enumerate(outs)]
    return JSONResponse({"object": "list", "data": data, "model": state.model_name, "usage": _usage(outs)})


async def _pair_scores(state: ServerState, engine: AsyncLLM,
                       pairs: list[tuple[str, str]]) -> tuple[list[float], dict[str, int]]:
    """A cross-encoder's score per pair, or the cosine similarity of the pair's embeddings."""
    tasks = engine.get_supported_tasks()
    if "score" in tasks:
        outs = await pool_all(state, engine, [{"text": a, "text_pair": b} for a, b in pairs],
                              PoolingParams("score"), "score")
        return [o.outputs.score for o in outs], _usage(outs)
    if "embed" not in tasks:
        raise APIError(400, "this model does not support scores", param="model", code="unsupported_task")
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
    outs = await pool_all(state, engine, texts, PoolingParams("embed", normalize=True), "score")
    vec = {t: o.outputs.data for t, o in zip(texts, outs)}
    import torch.nn.functional as F
    return [F.cosine_similarity(vec[a], vec[b], dim=0).item() for a, b in pairs], _usage(outs)


@router.post("/v1/rerank", openapi_extra=json_body(RerankRequest))
@router.post("/v2/rerank", openapi_extra=json_body(RerankRequest))
@router.post("/rerank", openapi_extra=json_body(RerankRequest))
async def rerank(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    req = await parse_body(request, RerankRequest)
    state.check_model(req.model)
    engine = state.ready_engine()
    docs = req.document_texts()
    if docs is None:
        raise bad_request("documents is required", "documents")
    if not req.query:
        raise bad_request("query must not be empty", "query")
    if not docs:
        raise bad_request("documents must not be empty", "documents")
    _check_count(state, len(docs), "documents")
    empty = next((i for i, d in enumerate(docs) if not d), None)
    if empty is not None:
        raise bad_request(f"documents[{empty}] is empty", "documents")
    scores, usage = await _pair_scores(state, engine, [(req.query, d) for d in docs])
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n or None]
    with_docs = req.return_documents if req.return_documents is not None else req.return_text is not False
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": docs[i]}} if with_docs else {})}
               for i in order]
    return JSONResponse({"id": new_id("rerank"), "object": "list", "model": state.model_name,
                         "results": results, "usage": usage})


@router.post("/v1/score", openapi_extra=json_body(ScoreRequest))
@router.post("/score", openapi_extra=json_body(ScoreRequest))
async def score(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    req = await parse_body(request, ScoreRequest)
    state.check_model(req.model)
    engine = state.ready_engine()
    try:
        pairs = score_pairs(req.text_1, req.text_2)
    except ScoreInputError as exc:
        raise bad_request(str(exc), "text_1") from None
    _check_count(state, len(pairs), "text_2")
    if any(not a or not b for a, b in pairs):
        raise bad_request("texts must not be empty", "text_2")
    scores, usage = await _pair_scores(state, engine, pairs)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return JSONResponse({"id": new_id("score"), "object": "list", "created": int(time.time()),
                         "model": state.model_name, "data": data, "usage": usage})
