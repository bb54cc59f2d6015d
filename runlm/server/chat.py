"""``POST /v1/chat/completions``: OpenAI's chat API, streamed or whole."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from runlm.server.body import parse_body
from runlm.server.context_shift import shift_keep
from runlm.server.errors import APIError, bad_request
from runlm.server.generation import Generation, Ticket, TicketedStreamingResponse, new_id, start_generation
from runlm.server.logprobs import TokenTexts, chat_logprobs
from runlm.server.prompts import chat_prompt, check_room_for_completion, fit_to_context
from runlm.server.protocol import ChatCompletionRequest
from runlm.server.reasoning import ReasoningPlan, reasoning_plan, template_kwargs, thinking_params
from runlm.server.sampling import to_sampling_params
from runlm.server.sse import DONE, HEADERS, error_event, event, usage
from runlm.server.state import ServerState
from runlm.server.structured import constraint_source
from runlm.server.tool_calls import DeltaBuilder, tool_plan, whole_message
from runlm.tools.choice import ToolPlan
from runlm.web.openapi import json_body

router = APIRouter()


@dataclass(slots=True)
class ChatRun:
    """A started chat completion: read it whole (``whole``) or as chunk dicts (``chunks``), once.
    The Responses and Anthropic routes (runlm/apis) read the same run and translate it."""
    gen: Generation
    ticket: Ticket
    req: ChatCompletionRequest
    model: str
    texts: TokenTexts | None
    plan: ToolPlan
    reasoning: ReasoningPlan | None = None

    async def whole(self) -> dict[str, Any]:
        try:
            return await _whole(self.gen, self.model, self.texts, self.plan, self.reasoning)
        finally:
            self.close()

    def chunks(self) -> AsyncIterator[dict[str, Any]]:
        return _chunks(self.gen, self.req, self.model, self.texts, self.plan, self.reasoning)

    def close(self) -> None:
        self.gen.close()
        self.ticket.release()


async def start_chat(request: Request, req: ChatCompletionRequest) -> ChatRun:
    """Check the request, build its prompt and add it to the engine (errors are APIErrors, raised before any
    output)."""
    state: ServerState = request.app.state.server
    lora = state.check_model(req.model)
    engine = state.require_task("generate", "chat completions")
    if req.continue_final_message and req.add_generation_prompt:  # vLLM refuses the pair the same way
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")
    plan = tool_plan(req, engine)
    params = to_sampling_params(req, plan.structured_outputs, state.settings.sampling_defaults)
    if plan.parser is not None and plan.parser.needs_special_tokens:
        params.skip_special_tokens = False  # the call markers are special tokens

    def render(messages: list[dict[str, Any]]) -> Awaitable[tuple[list[int], list[Any]]]:
        return chat_prompt(engine, messages, req.add_generation_prompt, plan.template_tools, template_kwargs(req),
                           state.settings.trust_request_chat_template, req.continue_final_message,
                           state.settings.media, state.model_name)

    prompt, images = await render(req.messages)
    if req.truncate:
        prompt, images = await fit_to_context(render, req.messages, (prompt, images),
                                              engine.max_model_len - (params.max_tokens or 1))
    reasoning = reasoning_plan(req, state, engine, prompt)
    if reasoning is not None and reasoning.parser.harmony:
        params.skip_special_tokens = False  # gpt-oss's channels are special tokens
    params.thinking = thinking_params(reasoning, req, engine, params.structured_outputs is not None)
    shift = shift_keep(req, state.settings)
    if shift is None:
        check_room_for_completion(engine, [prompt], params, "messages")
    gen, ticket = await start_generation(state, engine, request, [prompt], params, new_id("chatcmpl"), req.priority,
                                         "messages", constraint_source(req, plan.structured_outputs), lora,
                                         images=images, shift=shift)
    texts = TokenTexts(engine.tokenizer) if params.logprobs is not None else None
    model_name = lora.lora_name if lora else state.model_name  # answers name the adapter asked for, as vLLM's
    return ChatRun(gen, ticket, req, model_name, texts, plan, reasoning)


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    run = await start_chat(request, await parse_body(request, ChatCompletionRequest))
    if run.req.stream:
        return TicketedStreamingResponse(_sse(run), run.ticket, run.gen, media_type="text/event-stream",
                                         headers=HEADERS)
    return JSONResponse(await run.whole())


async def _sse(run: ChatRun) -> AsyncIterator[str]:
    try:
        async for chunk in run.chunks():
            yield event(chunk)
    except APIError as exc:
        yield error_event(exc)
        yield DONE
        return
    if run.gen.disconnected:
        return
    yield DONE


async def _whole(gen: Generation, model: str, texts: TokenTexts | None, plan: ToolPlan,
                 reasoning: ReasoningPlan | None) -> dict[str, Any]:
    n = gen.params.n
    content = [""] * n
    finish: list[str | None] = [None] * n
    stop_reason: list[int | str | None] = [None] * n
    tokens = [0] * n
    lps: list[list] = [[] for _ in range(n)]
    ids: list[list[int]] = [[] for _ in range(n)]
    prompt_tokens = cached = 0
    async for _, out in gen.stream():
        prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
        for c in out.outputs:
            content[c.index] += c.text
            tokens[c.index] += len(c.token_ids)
            if c.finish_reason is not None:
                finish[c.index], stop_reason[c.index] = c.finish_reason, c.stop_reason
            if texts is not None and c.logprobs:
                ids[c.index] += c.token_ids
                lps[c.index] += c.logprobs
    choices = []
    for i in range(n):
        logprobs = chat_logprobs(texts, ids[i], lps[i], gen.params.logprobs or 0) if texts is not None else None
        thinking: str | None = None
        if reasoning is not None:  # the thinking first; tool calls are read from the answer after it
            thinking, content[i] = reasoning.split(content[i])
        message, reason = whole_message(plan, content[i], finish[i])
        if reasoning is not None:
            message.update(reasoning.fields(thinking))
        choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason,
                        "stop_reason": stop_reason[i]})
    return {"id": gen.request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, sum(tokens), cached), "system_fingerprint": None}


async def _chunks(gen: Generation, req: ChatCompletionRequest, model: str,
                  texts: TokenTexts | None, plan: ToolPlan,
                  reasoning: ReasoningPlan | None) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunks as dicts (an APIError raised on a failure mid-way); the usage chunk last when asked."""
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    # vLLM's continuous_usage_stats: usage in every chunk, the prompt's tokens (counted before any output) first
    continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
    prompt_tokens, completion_tokens, cached = len(gen.prompts[0]), 0, 0

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        payload: dict[str, Any] = {"id": gen.request_id, "object": "chat.completion.chunk", "created": created,
                                   "model": model, "system_fingerprint": None, "choices": choices}
        if include_usage:
            payload["usage"] = usage(prompt_tokens, completion_tokens, cached) if continuous else None
        return payload

    def opening() -> list[dict[str, Any]]:
        return [chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}]) for i in range(gen.params.n)]

    # a prompt with images is counted once the engine has placed them (their tokens are the engine's to expand):
    # its opening chunks wait for the first output, so continuous usage counts the image tokens from the start
    opened = not gen.images
    if opened:
        for first in opening():
            yield first
    builders = [DeltaBuilder(plan) for _ in range(gen.params.n)]
    splitters = [reasoning.splitter() for _ in range(gen.params.n)] if reasoning is not None else None
    async for _, out in gen.stream():
        prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
        if not opened:
            opened = True
            for first in opening():
                yield first
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            if not c.text and not c.token_ids and c.finish_reason is None:
                continue
            text, thinking = c.text, ""
            if splitters is not None and reasoning is not None:  # the thinking first, then the answer's text
                thinking, text = splitters[c.index].push(text, final=c.finish_reason is not None)
            delta, reason = builders[c.index].delta(text, c.finish_reason)
            if reasoning is not None:  # no empty content while the model thinks
                delta = {k: v for k, v in delta.items() if v != ""}
                if thinking and reasoning.include:
                    delta = {**reasoning.fields(thinking), **delta}
            logprobs = (chat_logprobs(texts, c.token_ids, c.logprobs or [], gen.params.logprobs or 0)
                        if texts is not None and c.token_ids else None)
            if not delta and reason is None and logprobs is None:
                continue  # text held back (it may be the start of a tool call)
            if reason is not None and (delta or logprobs is not None):  # OpenAI: the finish comes with an empty delta
                yield chunk([{"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
                delta, logprobs = {}, None
            choice = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            if reason is not None:
                choice["stop_reason"] = c.stop_reason  # vLLM's extra: the stop string or token id that matched
            yield chunk([choice])
    if gen.disconnected:
        return
    if include_usage:
        yield {"id": gen.request_id, "object": "chat.completion.chunk", "created": created, "model": model,
               "system_fingerprint": None, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached)}
