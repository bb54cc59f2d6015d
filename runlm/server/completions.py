"""``POST /v1/completions``: OpenAI's (legacy) text completions, one or many prompts, streamed or whole.

Choice ``index`` runs over prompts, then over n: prompt p's k-th completion is ``p * n + k``.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from runlm.engine.types.outputs import CompletionOutput, Logprob, RequestOutput
from runlm.server.body import parse_body
from runlm.server.context_shift import shift_keep
from runlm.server.errors import APIError
from runlm.server.generation import Generation, TicketedStreamingResponse, new_id, start_generation
from runlm.server.logprobs import TokenTexts, completion_logprobs
from runlm.server.prompts import check_room_for_completion, completion_prompt_ids, fim_prompt_ids
from runlm.server.protocol import CompletionRequest
from runlm.server.sampling import to_sampling_params
from runlm.server.sse import DONE, HEADERS, error_event, event, usage
from runlm.server.state import ServerState
from runlm.server.structured import constraint_source
from runlm.web.openapi import json_body

router = APIRouter()


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = await parse_body(request, CompletionRequest)
    lora = state.check_model(req.model)
    engine = state.require_task("generate", "text completions")
    params = to_sampling_params(req, defaults=state.settings.sampling_defaults)
    limit = state.settings.max_prompts_per_request
    prompts = completion_prompt_ids(engine, req.prompt, limit) if req.suffix is None else \
        fim_prompt_ids(engine, req.prompt, req.suffix, bool(req.echo), limit)
    shift = shift_keep(req, state.settings)
    if shift is None:
        check_room_for_completion(engine, prompts, params, "prompt")
    gen, ticket = await start_generation(state, engine, request, prompts, params, new_id("cmpl"), req.priority,
                                         "prompt", constraint_source(req), lora, shift=shift)
    view = _View(gen, TokenTexts(engine.tokenizer), bool(req.echo), lora.lora_name if lora else state.model_name)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return TicketedStreamingResponse(_stream(view, include_usage), ticket, gen,
                                         media_type="text/event-stream", headers=HEADERS)
    try:
        body = await _whole(view)
    finally:
        gen.close()
        ticket.release()
    return JSONResponse(body)


@dataclass(slots=True)
class _View:
    """Turns engine outputs into completion choices: echo, logprobs and text offsets per choice."""
    gen: Generation
    texts: TokenTexts
    echo: bool
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    offsets: dict[int, int] = field(default_factory=dict)   # choice index -> characters sent so far
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def choice(self, p: int, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        index = p * self.gen.params.n + c.index
        self.prompt_tokens[p], self.cached_tokens[p] = len(out.prompt_token_ids), out.num_cached_tokens
        self.completion_tokens += len(c.token_ids)
        text, ids = c.text, list(c.token_ids)
        entries: list[dict[int, Logprob] | None] = list(c.logprobs or [])
        first = index not in self.offsets
        if first and self.echo:
            prompt_text = out.prompt if out.prompt is not None else self.texts.tok.decode(out.prompt_token_ids)
            text = prompt_text + text
            ids = out.prompt_token_ids + ids
            entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(text)
        k = self.gen.params.logprobs
        logprobs = completion_logprobs(self.texts, ids, entries, k, offset) if k is not None else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def usage(self) -> dict[str, Any]:
        return usage(sum(self.prompt_tokens.values()), self.completion_tokens, sum(self.cached_tokens.values()))

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.gen.request_id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": None, "choices": choices, **extra}


async def _whole(view: _View) -> dict[str, Any]:
    merged: dict[int, dict[str, Any]] = {}
    async for p, out in view.gen.stream():
        for c in out.outputs:
            ch = view.choice(p, out, c)
            prev = merged.get(ch["index"])
            if prev is None:
                merged[ch["index"]] = ch
                continue
            prev["text"] += ch["text"]
            prev["finish_reason"], prev["stop_reason"] = ch["finish_reason"], ch["stop_reason"]
            if prev["logprobs"] is not None:
                for key in prev["logprobs"]:
                    prev["logprobs"][key] += ch["logprobs"][key]
    choices = [merged[i] for i in sorted(merged)]
    return view.body(choices, usage=view.usage())


async def _stream(view: _View, include_usage: bool) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}
    try:
        async for p, out in view.gen.stream():
            for c in out.outputs:
                first = p * view.gen.params.n + c.index not in view.offsets
                if not (c.text or c.token_ids or c.finish_reason or (first and view.echo)):
                    continue
                yield event(view.body([view.choice(p, out, c)], **extra))
    except APIError as exc:
        yield error_event(exc)
        yield DONE
        return
    if view.gen.disconnected:
        return
    if include_usage:
        yield event(view.body([], usage=view.usage()))
    yield DONE
