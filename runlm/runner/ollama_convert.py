"""Ollama request/response shapes <-> the OpenAI requests our backends speak."""
from __future__ import annotations

import datetime as dt
import json
from typing import Any

from runlm.apis.ollama_images import ollama_content
from runlm.runner.errors import BadRequest
from runlm.runner.ollama_options import LoadOptions, ollama_options
from runlm.store import StoredModel


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def sampling_fields(body: dict) -> tuple[dict[str, Any], LoadOptions]:
    """The request's options and ``format`` as OpenAI fields, and what it asks of the runner's load. A generation
    that fills the context goes on (Ollama's ``shift``, on unless the request says false)."""
    out, load = ollama_options(body)
    out["context_shift"] = body.get("shift") is not False
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise BadRequest("'format' must be \"json\" or a JSON schema object", param="format")
    if body.get("structured_outputs") is not None:  # runlm's extension (a regex, a grammar...): the backend checks it
        out["structured_outputs"] = body["structured_outputs"]
    return out, load


def chat_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list):
        raise BadRequest("'messages' must be a list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] needs a 'role' and a 'content'", param="messages")
        content = ollama_content(m.get("content") or "", m.get("images"), f"messages[{i}].images", refuse_image)
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if m["role"] == "assistant" and isinstance(m.get("thinking"), str) and m["thinking"]:
            msg["reasoning_content"] = m["thinking"]  # the template may show it again (Qwen3's)
        if m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]", f"call_{i}_{j}")
                                 for j, c in enumerate(_as_list(m["tool_calls"], f"messages[{i}].tool_calls"))]
        out.append(msg)
    return out


def refuse_image(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param)


THINK_LEVELS = ("low", "medium", "high")


def thinking_fields(body: dict, messages: list[dict]) -> dict[str, Any]:
    """Ollama's ``think`` (true, false, or a level) as chat's reasoning fields; a final assistant message is
    continued, as Ollama continues it."""
    out: dict[str, Any] = {}
    think = body.get("think")
    if think is False:
        out.update(chat_template_kwargs={"enable_thinking": False}, include_reasoning=False)
    elif think is True:
        out["chat_template_kwargs"] = {"enable_thinking": True}
    elif think in THINK_LEVELS:
        out.update(chat_template_kwargs={"enable_thinking": True}, reasoning_effort=think)
    elif think is not None:
        raise BadRequest("'think' must be true, false, \"low\", \"medium\" or \"high\"", param="think")
    if messages and messages[-1]["role"] == "assistant":
        out.update(add_generation_prompt=False, continue_final_message=True)
    return out


def _as_list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a list", param=where)
    return value


def _tool_call(call: Any, where: str, call_id: str) -> dict:
    """Ollama's {"function": {"name", "arguments": {...}}} as OpenAI's tool call; anything else is a 400."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadRequest(f"{where} must be {{\"function\": {{\"name\": ..., \"arguments\": {{...}}}}}}", param=where)
    args = fn.get("arguments") or {}
    if not isinstance(args, dict):
        raise BadRequest(f"{where}.function.arguments must be an object", param=f"{where}.function.arguments")
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": json.dumps(args)}}


def merge_tool_call_deltas(deltas: list[dict]) -> list[dict]:
    """A stream's ``tool_calls`` deltas (the first of a call with its name, then pieces of its arguments, each
    carrying the call's ``index``) as whole calls, in order."""
    calls: dict[Any, dict] = {}
    for d in deltas:
        fn = d.get("function") or {}
        call = calls.setdefault(d.get("index", len(calls)), {"function": {"name": "", "arguments": ""}})
        call["function"]["name"] += fn.get("name") or ""
        args = fn.get("arguments")
        if isinstance(args, str):
            call["function"]["arguments"] += args
        elif args is not None:  # already whole (an object)
            call["function"]["arguments"] = args
    return list(calls.values())


def ollama_tool_calls(calls: list[dict] | None) -> list[dict] | None:
    if not calls:
        return None
    out = []
    for c in merge_tool_call_deltas(calls):
        fn = c.get("function") or {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else (args or {})
        except json.JSONDecodeError:
            args = {"_raw": args}
        out.append({"function": {"name": fn.get("name", ""), "arguments": args}})
    return out


def details(model: StoredModel) -> dict:
    info = model.info
    families = [info.architecture, *(["clip"] if model.mmproj else [])]  # Ollama lists a projector's "clip"
    return {"parent_model": "", "format": info.format, "family": info.architecture, "families": families,
            "parameter_size": info.parameter_size, "quantization_level": info.quantization}


def tag_entry(model: StoredModel) -> dict:
    return {"name": str(model.name), "model": str(model.name), "modified_at": model.created, "size": model.size,
            "digest": model.id.removeprefix("sha256:"), "details": details(model)}


def timings(t0: float, t_loaded: float, t_first: float | None, t_end: float, usage: dict | None) -> dict:
    ns = 1_000_000_000
    t_first = t_first or t_end
    usage = usage or {}
    return {"total_duration": int((t_end - t0) * ns), "load_duration": int((t_loaded - t0) * ns),
            "prompt_eval_count": usage.get("prompt_tokens", 0), "prompt_eval_duration": int((t_first - t_loaded) * ns),
            "eval_count": usage.get("completion_tokens", 0), "eval_duration": int((t_end - t_first) * ns)}


def backend_error_message(content: bytes) -> str:
    try:
        err = json.loads(content).get("error")
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, AttributeError):
        return content.decode(errors="replace")[:500]


MAX_TOP_LOGPROBS = 20


def logprob_fields(body: dict, route: str) -> dict[str, Any]:
    """Ollama's ``logprobs`` (bool) and ``top_logprobs`` (0-20) as the OpenAI route's fields."""
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if want in (None, False):
        if top:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return {}
    if want is not True:
        raise BadRequest("'logprobs' must be true or false", param="logprobs")
    top = 0 if top is None else top
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}", param="top_logprobs")
    return {"logprobs": True, "top_logprobs": top} if route == "chat/completions" else {"logprobs": top}


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def ollama_logprobs(lp: dict | None, top: int) -> list[dict] | None:
    """A chunk's OpenAI logprobs (chat's ``content`` list, or completions' parallel lists, whose top dict also
    holds the chosen token) as Ollama's list of {token, logprob, bytes, top_logprobs} with ``top`` alternatives."""
    if not lp:
        return None
    if lp.get("content") is not None:
        return [{**_entry(c["token"], c["logprob"]),
                 "top_logprobs": [_entry(t["token"], t["logprob"]) for t in c.get("top_logprobs") or []]}
                for c in lp["content"]]
    tokens, values = lp.get("tokens") or [], lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or [None] * len(tokens)
    return [{**_entry(t, v), "top_logprobs": [_entry(k, x) for k, x in
                                              sorted((alts or {}).items(), key=lambda kv: -kv[1])[:top]]}
            for t, v, alts in zip(tokens, values, tops)]
