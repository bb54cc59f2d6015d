"""Ollama request/response shapes <-> the OpenAI requests our backends speak."""
from __future__ import annotations

import datetime as dt
import json
from typing import Any

from runlm.apis.ollama_images import ollama_content
from runlm.runner.errors import BadRequest
from runlm.store import StoredModel

# Ollama option -> OpenAI (or vLLM-extension) sampling field
OPTION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "seed": "seed", "stop": "stop", "num_predict": "max_tokens", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "repeat_penalty": "repetition_penalty"}
# options that are about loading or the machine, not sampling: accepted and ignored, as Ollama does when loaded
IGNORED_OPTIONS = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "num_thread",
                   "numa", "num_keep", "typical_p", "repeat_last_n", "penalize_newline", "low_vram", "vocab_only",
                   "mirostat", "mirostat_tau", "mirostat_eta", "tfs_z"}


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def sampling_fields(body: dict) -> dict[str, Any]:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'options' must be an object", param="options")
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key in OPTION_FIELDS:
            if key == "num_predict" and isinstance(value, int) and value < 0:
                continue  # -1: until the model stops (or the context is full)
            out[OPTION_FIELDS[key]] = value
        elif key not in IGNORED_OPTIONS:
            raise BadRequest(f"unknown option {key!r}", param=f"options.{key}")
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise BadRequest("'format' must be \"json\" or a JSON schema object", param="format")
    return out


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


def ollama_tool_calls(calls: list[dict] | None) -> list[dict] | None:
    if not calls:
        return None
    out = []
    for c in calls:
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
