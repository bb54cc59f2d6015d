"""``POST /infill``: llama-server's fill-in-the-middle endpoint (llama.vscode, Tabby and other editor plug-ins).

The prompt is llama-server's, token for token (runlm.formats.fim.infill_prompt): other files (``input_extra``)
before the prefix, then prefix, ``prompt``, suffix, middle. Sampling takes llama-server's names (``n_predict``,
``repeat_penalty``, ``n_probs``...); the answer is its native completion shape, streamed as SSE ``data:`` lines
or whole. Unknown fields are ignored, as everywhere on this server (llama.vscode's ``cache_prompt``,
``t_max_*``, ``samplers``: the prefix cache is always on, the sampler order is runlm's).
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from pydantic import Field, StrictStr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from runlm.formats.fim import ExtraChunk, NoFim, infill_prompt
from runlm.server.body import parse_body
from runlm.server.errors import APIError, bad_request
from runlm.server.generation import TicketedStreamingResponse, new_id, start_generation
from runlm.server.protocol import CompletionRequest, Float, Int, LlamaSamplers, _Body
from runlm.server.sampling import to_sampling_params
from runlm.server.sse import HEADERS, error_event
from runlm.server.state import ServerState
from runlm.web.openapi import json_body

router = APIRouter()
MAX_EXTRA_CHUNKS = 256


class ExtraContext(_Body):
    text: StrictStr
    filename: StrictStr = "tmp"


class InfillRequest(LlamaSamplers):
    """llama-server's /infill body (its sampling names)."""
    model: StrictStr | None = None
    input_prefix: StrictStr
    input_suffix: StrictStr
    input_extra: list[ExtraContext] = Field(default_factory=list, max_length=MAX_EXTRA_CHUNKS)
    prompt: StrictStr = ""
    stream: bool = False
    n_predict: Int = -1
    temperature: Float | None = None
    top_k: Int | None = None
    top_p: Float | None = None
    min_p: Float | None = None
    seed: Int | None = None
    stop: list[StrictStr] | None = None
    repeat_penalty: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    ignore_eos: bool = False
    n_probs: Int | None = None


_RENAMED = {"repeat_penalty": "repetition_penalty", "n_probs": "logprobs"}
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty", "presence_penalty",
             "frequency_penalty", "ignore_eos", "n_probs", *LlamaSamplers.model_fields)


@router.post("/infill", openapi_extra=json_body(InfillRequest))
async def infill(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = await parse_body(request, InfillRequest)
    lora = state.check_model(req.model)
    engine = state.require_task("generate", "fill-in-the-middle")
    tok = engine.tokenizer
    try:
        fim = tok.fim
    except NoFim as exc:
        raise bad_request(f"Infill is not supported by this model: {exc}", "input_prefix", "fim_unsupported") from None
    ids = infill_prompt(tok, fim, req.input_prefix, req.input_suffix,
                        [ExtraChunk(c.text, c.filename) for c in req.input_extra], req.prompt, engine.max_model_len)
    room = engine.max_model_len - len(ids)
    if room < 1:
        raise bad_request(f"the infill prompt is {len(ids)} tokens; this model's context is {engine.max_model_len}",
                          "input_extra", "context_length_exceeded")
    fields = {_RENAMED.get(k, k): getattr(req, k) for k in _SAMPLING if getattr(req, k) is not None}
    fields["max_tokens"] = room if req.n_predict < 0 else max(1, req.n_predict)
    params = to_sampling_params(CompletionRequest(prompt=ids, **fields), defaults=state.settings.sampling_defaults)
    gen, ticket = await start_generation(state, engine, request, [ids], params, new_id("infill"), 0, "input_prefix",
                                         None, lora)
    shape = _Shape(tok.decode(ids), lora.lora_name if lora else state.model_name, len(ids))
    if req.stream:
        return TicketedStreamingResponse(_stream(gen, shape), ticket, gen, media_type="text/event-stream",
                                         headers=HEADERS)
    try:
        final: dict[str, Any] = {}
        text: list[str] = []
        async for _, out in gen.stream():
            for c in out.outputs:
                text.append(c.text)
                shape.chunk(c.text, len(c.token_ids))
                if c.finish_reason:
                    final = shape.final(c.finish_reason, c.stop_reason)
    finally:
        gen.close()
        ticket.release()
    return JSONResponse({**final, "content": "".join(text)})


class _Shape:
    """llama-server's native completion fields."""

    def __init__(self, prompt: str, model: str, n_prompt: int) -> None:
        self.prompt, self.model, self.n_prompt = prompt, model, n_prompt
        self.t0 = time.monotonic()
        self.t_first: float | None = None
        self.predicted = 0

    def chunk(self, text: str, n_tokens: int) -> dict[str, Any]:
        self.t_first = self.t_first or time.monotonic()
        self.predicted += n_tokens
        return {"index": 0, "content": text, "stop": False, "id_slot": -1, "tokens_predicted": self.predicted,
                "tokens_evaluated": self.n_prompt}

    def final(self, finish: str | None, stop_reason: Any) -> dict[str, Any]:
        now = time.monotonic()
        first = self.t_first or now
        stop_type = "limit" if finish == "length" else "word" if isinstance(stop_reason, str) else "eos"
        prompt_ms, predicted_ms = (first - self.t0) * 1000, (now - first) * 1000
        return {"index": 0, "content": "", "stop": True, "id_slot": -1, "model": self.model, "prompt": self.prompt,
                "tokens_predicted": self.predicted, "tokens_evaluated": self.n_prompt, "stop_type": stop_type,
                "stopping_word": stop_reason if isinstance(stop_reason, str) else "", "truncated": False,
                "timings": {"prompt_n": self.n_prompt, "prompt_ms": prompt_ms,
                            "predicted_n": self.predicted, "predicted_ms": predicted_ms,
                            "predicted_per_second": self.predicted / predicted_ms * 1000 if predicted_ms else 0.0}}


async def _stream(gen: Any, shape: _Shape) -> AsyncIterator[str]:
    try:
        async for _, out in gen.stream():
            for c in out.outputs:
                if c.text or c.token_ids:
                    yield f"data: {json.dumps(shape.chunk(c.text, len(c.token_ids)))}\n\n"
                if c.finish_reason:
                    yield f"data: {json.dumps(shape.final(c.finish_reason, c.stop_reason))}\n\n"
    except APIError as exc:
        yield error_event(exc)
