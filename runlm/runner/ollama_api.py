"""Ollama's API (/api/...) translated onto OpenAI requests to the backends, NDJSON streamed back."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from runlm import __version__
from runlm.apis.ollama_images import ollama_content
from runlm.formats.sampling_defaults import ollama_parameters
from runlm.runner.config import BackendMode
from runlm.runner.errors import BadRequest, RunnerError
from runlm.runner.models_api import body_json, delete_model, get_model
from runlm.runner.ollama_convert import (
    backend_error_message,
    chat_messages,
    details,
    logprob_fields,
    now_iso,
    ollama_logprobs,
    ollama_tool_calls,
    refuse_image,
    sampling_fields,
    tag_entry,
    thinking_fields,
    timings,
)
from runlm.runner.ollama_images import generate_image
from runlm.runner.ollama_options import LoadOptions
from runlm.runner.ollama_stream import answer, events, open_stream
from runlm.runner.proxy import pop_keep_alive, require_model, send
from runlm.runner.pulling import progress_response, pull_events, transfer_events
from runlm.runner.requests import (
    ChatRequest,
    CopyRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    ModelRequest,
)
from runlm.store import InvalidNameError, StoredModel
from runlm.store.capabilities import capabilities
from runlm.store.modelfile_model import chat_defaults, parameters_of, show_modelfile
from runlm.web.openapi import OllamaError, json_body

router = APIRouter(prefix="/api")
@router.get("/version", openapi_extra=json_body(error=OllamaError))
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/tags", openapi_extra=json_body(error=OllamaError))
async def tags(request: Request) -> JSONResponse:
    models = await asyncio.to_thread(request.app.state.store.list)
    return JSONResponse({"models": [tag_entry(m) for m in models]})


@router.get("/ps", openapi_extra=json_body(error=OllamaError))
async def ps(request: Request) -> JSONResponse:
    out = []
    for r in request.app.state.loader.runners.values():
        entry = tag_entry(r.model)
        entry.update(size=r.memory.ram + r.memory.vram, size_vram=r.memory.vram,
                     context_length=r.backend.context_size(r.model, r.config),
                     kv_cache_dtype=r.backend.kv_cache_dtype(r.config),
                     expires_at=(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.expires_at)) if r.expires_at
                                 else "2318-01-01T00:00:00Z" if r.keep_alive < 0 or r.in_use else now_iso()))
        out.append(entry)
    return JSONResponse({"models": out})


@router.post("/show", openapi_extra=json_body(ModelRequest, error=OllamaError))
async def show(request: Request) -> JSONResponse:
    body = await body_json(request, ModelRequest)
    name = body.get("model") or body.get("name")
    if not isinstance(name, str):
        raise BadRequest("'model' is required", param="model")
    model = await get_model(request, name)
    info = model.info
    entry = model.manifest.get("modelfile") or {}
    return JSONResponse({
        "modelfile": show_modelfile(model), "parameters": ollama_parameters(parameters_of(model)),
        "template": info.template or "", **({"system": entry["system"]} if entry.get("system") else {}),
        **({"license": "\n".join(entry["license"])} if entry.get("license") else {}),
        **({"messages": entry["messages"]} if entry.get("messages") else {}),
        "details": details(model), "capabilities": capabilities(model), "modified_at": model.created,
        "model_info": {"general.architecture": info.architecture, "general.parameter_count": info.parameters,
                       f"{info.architecture}.context_length": info.context_length,
                       f"{info.architecture}.block_count": info.num_layers,
                       **({f"{info.architecture}.expert_count": info.experts,
                           f"{info.architecture}.expert_used_count": info.experts_used} if info.experts else {})},
        **({"projector_info": projector} if (projector := await asyncio.to_thread(projector_info, request, model))
           else {})})


def projector_info(request: Request, model: StoredModel) -> dict | None:
    """Ollama's ``projector_info``: the mmproj file's clip.* header values (scalars and short arrays)."""
    entry = next((f for f in model.manifest["files"] if f["path"] == model.mmproj), None)
    if entry is None:
        return None
    from runlm.formats.gguf_header import read_header

    try:
        _, metadata, _ = read_header(request.app.state.store.blobs.path(entry["digest"]))
    except (OSError, ValueError, IndexError, KeyError):
        return None
    out: dict[str, Any] = {}
    for key, value in metadata.items():
        if key == "general.architecture" or key.startswith("clip."):
            value = value.tolist() if hasattr(value, "tolist") else value
            if isinstance(value, str | int | float | bool) or isinstance(value, list) and len(value) <= 16:
                out[key] = value
    return out


@router.post("/pull", openapi_extra=json_body(ModelRequest, error=OllamaError))
async def pull(request: Request) -> Response:
    body = await body_json(request, ModelRequest)
    source = body.get("model") or body.get("name")
    if not isinstance(source, str) or not source:
        raise BadRequest("'model' is required", param="model")
    events = pull_events(request.app.state.store, source, None, request.app.state.local_access,
                         insecure=bool(body.get("insecure")))
    return await progress_response(body, events)


@router.post("/push", openapi_extra=json_body(ModelRequest, error=OllamaError))
async def push(request: Request) -> Response:
    """Ollama's push: ``model`` is the registry reference (host/namespace/name:tag) to push to."""
    from runlm.store.oci.transfer import push_reference

    body = await body_json(request, ModelRequest)
    target = body.get("model") or body.get("name")
    if not isinstance(target, str) or not target:
        raise BadRequest("'model' is required: the registry reference to push to (host/namespace/name:tag)",
                         param="model")
    store, insecure = request.app.state.store, bool(body.get("insecure"))
    return await progress_response(body, transfer_events(lambda put: push_reference(store, target, insecure, put)))


@router.delete("/delete", openapi_extra=json_body(ModelRequest, error=OllamaError))
async def delete(request: Request) -> Response:
    body = await body_json(request, ModelRequest)
    name = body.get("model") or body.get("name")
    if not isinstance(name, str):
        raise BadRequest("'model' is required", param="model")
    await delete_model(request, name, force=bool(body.get("force")))
    return Response(status_code=200)


@router.post("/copy", openapi_extra=json_body(CopyRequest, error=OllamaError))
async def copy(request: Request) -> Response:
    body = await body_json(request, CopyRequest)
    src, dst = body.get("source"), body.get("destination")
    if not isinstance(src, str) or not isinstance(dst, str):
        raise BadRequest("'source' and 'destination' are required")
    await get_model(request, src)
    try:
        await asyncio.to_thread(request.app.state.store.tag, src, dst)
    except InvalidNameError as exc:  # (a name conflict is the app's 409)
        raise BadRequest(str(exc), param="destination") from None
    return Response(status_code=200)


async def _load_or_unload(request: Request, name: str, keep_alive: float | None, chat: bool,
                          load: LoadOptions) -> JSONResponse:
    """Ollama's way to load (empty prompt, as its options ask) or unload (and keep_alive 0) a model."""
    loader = request.app.state.loader
    if keep_alive == 0:
        await loader.unload_idle_models(name)  # never from under a request that holds it
        reason = "unload"
    else:
        model = await loader.model(name)
        image = "image-generation" in model.info.capabilities
        runner = await loader.acquire(name, None, BackendMode.IMAGE_GENERATION if image else BackendMode.COMPLETION,
                                      load)
        loader.release(runner, keep_alive)
        reason = "load"
    out: dict[str, Any] = {"model": name, "created_at": now_iso(), "done": True, "done_reason": reason}
    out.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return JSONResponse(out)


async def _generate(request: Request, body: dict, route: str, payload: dict, load: LoadOptions,
                    shape: Callable[[str, str, list | None], dict]) -> Response:
    """Run one generation on the backend, answering as Ollama does (NDJSON stream or one object)."""
    name = require_model(body)
    keep_alive = pop_keep_alive(body)
    loader = request.app.state.loader
    t0 = time.monotonic()
    payload.update(stream=True, stream_options={"include_usage": True}, **logprob_fields(body, route))
    runner, resp = await open_stream(loader, name, BackendMode.COMPLETION, f"/v1/{route}", payload, keep_alive,
                                     load)
    t_loaded = time.monotonic()

    async def chunks() -> AsyncGenerator[dict, None]:
        usage, finish, t_first = None, "stop", None
        tools: list[dict] = []
        want_logprobs = "logprobs" in payload
        top = int(payload.get("top_logprobs", payload.get("logprobs")) or 0)
        async with contextlib.aclosing(events(loader, runner, resp, keep_alive)) as evs:
            async for ev in evs:
                if ev.get("error"):
                    yield ev
                    return
                usage = ev.get("usage") or usage
                for choice in ev.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") if route == "chat/completions" else choice.get("text")
                    thinking = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    tools += delta.get("tool_calls") or []
                    finish = choice.get("finish_reason") or finish
                    lps = ollama_logprobs(choice.get("logprobs"), top) if want_logprobs else None
                    if text or thinking or lps:
                        t_first = t_first or time.monotonic()
                        yield {"model": name, "created_at": now_iso(), **shape(text or "", thinking, None),
                               **({"logprobs": lps} if lps else {}), "done": False}
        final = {"model": name, "created_at": now_iso(), **shape("", "", ollama_tool_calls(tools)),
                 "done": True, "done_reason": finish}
        yield final | timings(t0, t_loaded, t_first, time.monotonic(), usage)

    return await answer(request, body, chunks(), _whole)


async def _whole(chunks: AsyncGenerator[dict, None]) -> Response:
    """A non-streamed Ollama answer: the chunks joined into the final object."""
    parts: list[str] = []
    thinking: list[str] = []
    logprobs: list[dict] = []
    final: dict = {}
    try:
        async for c in chunks:
            if "error" in c:
                return JSONResponse({"error": c["error"]}, status_code=503)
            if not c["done"]:
                parts.append(c.get("response") or c.get("message", {}).get("content", ""))
                thinking.append(c.get("thinking") or c.get("message", {}).get("thinking", ""))
                logprobs += c.get("logprobs") or []
            else:
                final = c
    finally:
        await chunks.aclose()  # closing it closes the backend stream
    key = "message" if "message" in final else "response"
    if key == "message":
        final["message"]["content"] = "".join(parts)
        if any(thinking):
            final["message"]["thinking"] = "".join(thinking)
    else:
        final["response"] = "".join(parts)
        if any(thinking):
            final["thinking"] = "".join(thinking)
    if logprobs:
        final["logprobs"] = logprobs
    return JSONResponse(final)


def _chat_shape(text: str, thinking: str, tool_calls: list | None) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        msg["thinking"] = thinking
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return {"message": msg}


@router.post("/chat", openapi_extra=json_body(ChatRequest, error=OllamaError))
async def chat(request: Request) -> Response:
    body = await body_json(request, ChatRequest)
    name = require_model(body)
    if not body.get("messages"):
        return await _load_or_unload(request, name, pop_keep_alive(body), True, sampling_fields(body)[1])
    messages = chat_messages(body["messages"])
    fields, load = sampling_fields(body)
    payload: dict[str, Any] = {"messages": messages, **fields, **thinking_fields(body, messages),
                               "truncate": body.get("truncate") is not False}  # Ollama drops the oldest messages
    if body.get("tools"):
        payload["tools"] = body["tools"]
    return await _generate(request, body, "chat/completions", payload, load, _chat_shape)


@router.post("/generate", openapi_extra=json_body(GenerateRequest, error=OllamaError))
async def generate(request: Request) -> Response:
    body = await body_json(request, GenerateRequest)
    name = require_model(body)
    prompt = body.get("prompt")
    if not prompt:
        return await _load_or_unload(request, name, pop_keep_alive(body), False, sampling_fields(body)[1])
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string", param="prompt")
    if body.get("context"):
        raise BadRequest("'context' (token ids of an earlier answer) is not supported: send the conversation as "
                         "messages to /api/chat", param="context")
    if body.get("images") and body.get("raw"):
        raise BadRequest("images go through the model's chat template; a raw prompt cannot carry them", param="images")
    if "image-generation" in (await request.app.state.loader.model(name)).info.capabilities:
        return await generate_image(request, body, name)
    fields, load = sampling_fields(body)
    suffix = body.get("suffix")  # (a string: GenerateRequest checked it)
    if suffix:  # fill-in-the-middle: the backend builds the prompt from the model's FIM tokens
        if body.get("images"):
            raise BadRequest("a fill-in-the-middle prompt (suffix) cannot carry images", param="images")
        payload: dict[str, Any] = {"prompt": prompt, "suffix": suffix, **fields}
        route = "completions"
    elif body.get("raw"):
        payload = {"prompt": prompt, **fields}
        route = "completions"
    elif body.get("template"):  # the request's template, rendered here: the backend gets the prompt it makes
        if body.get("images"):
            raise BadRequest("images go through the model's own chat template; send them without 'template'",
                             param="images")
        payload = {"prompt": await _templated_prompt(request, name, body, prompt), **fields}
        route = "completions"
    else:
        messages = [{"role": "system", "content": body["system"]}] if body.get("system") else []
        content = ollama_content(prompt, body.get("images"), "images", refuse_image)
        payload = {"messages": messages + [{"role": "user", "content": content}], **fields,
                   **thinking_fields(body, [])}
        route = "chat/completions"
    return await _generate(request, body, route, payload, load, _generate_shape)


async def _templated_prompt(request: Request, name: str, body: dict, prompt: str) -> str:
    """``prompt`` through the request's ``template`` (Go or Jinja) as Ollama renders a generate request: the system
    prompt (the request's, else the model's Modelfile SYSTEM), the Modelfile's MESSAGEs, then the prompt; in a
    template worker, within the limits every chat template renders in."""
    from runlm.formats.chat_template import ChatTemplateError, render_chat
    from runlm.formats.modelfile import ChatDefaults
    from runlm.formats.template_limits import RenderLimitError
    from runlm.formats.template_render import template_problem
    from runlm.formats.tokenizer import MAX_TEMPLATE_FILE

    template = body["template"]
    if why := template_problem(template, MAX_TEMPLATE_FILE):
        raise BadRequest(f"'template' {why}", param="template")
    defaults = chat_defaults(await request.app.state.loader.model(name)) or ChatDefaults()
    system = [{"role": "system", "content": body["system"]}] if body.get("system") else []
    messages = defaults.chat([*system, {"role": "user", "content": prompt}])
    try:
        return await asyncio.to_thread(render_chat, messages, template)
    except (ChatTemplateError, RenderLimitError) as exc:
        raise BadRequest(f"'template' failed: {exc}", param="template") from None


def _generate_shape(text: str, thinking: str, _: list | None) -> dict:
    return {"response": text, **({"thinking": thinking} if thinking else {})}


async def _embed(request: Request, body: dict, inputs: Any) -> tuple[list, dict, float]:
    name = require_model(body)
    keep_alive = pop_keep_alive(body)
    loader = request.app.state.loader
    t0 = time.monotonic()
    runner = await loader.acquire(name, None, BackendMode.EMBEDDING)
    try:
        payload: dict[str, Any] = {"model": runner.model_ref, "input": inputs}
        if body.get("truncate", True) is not False:  # Ollama cuts what is too long unless truncate is false
            payload["truncate_prompt_tokens"] = -1
        if body.get("dimensions"):
            payload["dimensions"] = body["dimensions"]
        resp = await send(runner, "POST", "/v1/embeddings", payload)
        if resp.status_code != 200:
            raise RunnerError(backend_error_message(resp.content), status=resp.status_code)
        data = resp.json()
    finally:
        loader.release(runner, keep_alive)
    vectors = [d["embedding"] for d in sorted(data["data"], key=lambda d: d["index"])]
    return vectors, data.get("usage") or {}, t0


@router.post("/embed", openapi_extra=json_body(EmbedRequest, error=OllamaError))
async def embed(request: Request) -> JSONResponse:
    body = await body_json(request, EmbedRequest)
    inputs = body.get("input")
    if not isinstance(inputs, (str, list)) or not inputs:
        raise BadRequest("'input' must be a string or a list of strings", param="input")
    vectors, usage, t0 = await _embed(request, body, inputs)
    return JSONResponse({"model": body["model"], "embeddings": vectors,
                         "total_duration": int((time.monotonic() - t0) * 1e9),
                         "prompt_eval_count": usage.get("prompt_tokens", 0)})


@router.post("/embeddings", openapi_extra=json_body(EmbeddingsRequest, error=OllamaError))
async def embeddings(request: Request) -> JSONResponse:
    body = await body_json(request, EmbeddingsRequest)
    if not isinstance(body.get("prompt"), str):
        raise BadRequest("'prompt' must be a string", param="prompt")
    vectors, _, _ = await _embed(request, body, body["prompt"])
    return JSONResponse({"embedding": vectors[0]})
