"""A Responses request (``POST /v1/responses``) as the chat-completion request that answers it.

``input`` (a string or a list of items), ``instructions``, function ``tools`` and ``tool_choice``,
``text.format``, ``max_output_tokens``, ``temperature`` / ``top_p`` map onto chat completions' own fields, so
prompts, tool calls and structured outputs are the chat path's. Hosted tools (web search, files...) and
``input_image`` parts become chat's ``image_url`` parts (the server decodes and checks them); files and audio
are refused by name."""
from __future__ import annotations

from typing import Any

from runlm.apis.source import CLIENT_PATH, bad_request, finish_chat_request

# chat-completion field -> the Responses field the client sent, to name it in errors
PARAM_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
               "response_format": "text.format", "response_format.json_schema": "text.format",
               "response_format.json_schema.schema": "text.format.schema", "tools": "tools",
               "tool_choice": "tool_choice"}
_PASSED = ("temperature", "top_p", "parallel_tool_calls", "top_k", "min_p", "seed", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "dry_multiplier", "dry_base", "dry_allowed_length",
           "dry_penalty_last_n", "stop", "priority",
           # vLLM's extras for reasoning models and prompts
           "thinking_token_budget", "include_reasoning", "chat_template_kwargs", "continue_final_message",
           "add_generation_prompt", "ignore_eos")


def _text_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            parts.append(image_part(part, f"{where}[{j}]"))
        elif kind in ("input_file", "input_audio"):
            raise bad_request(f"{where}[{j}]: {kind} inputs are not supported (runlm's models take text and images)",
                              f"{where}[{j}]")
        else:
            raise bad_request(f"{where}[{j}] must be a part like {{'type': 'input_text', 'text': '...'}}",
                              f"{where}[{j}]")
    return parts


def image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``input_image`` part (``image_url``: a data: URL, or a URL the server may be allowed to fetch) as chat's
    ``image_url`` part."""
    url = part.get("image_url")
    if isinstance(url, dict):  # (some clients send chat's shape here)
        url = url.get("url")
    if not isinstance(url, str) or not url:
        if part.get("file_id") is not None:
            raise bad_request(f"{where}: input_image by file_id is not supported (there is no files API); send "
                              f"image_url as a data: URL", f"{where}.file_id")
        raise bad_request(f"{where}.image_url must be a URL string (data:image/png;base64,...)", f"{where}.image_url")
    image: dict[str, Any] = {"url": url}
    if isinstance(part.get("detail"), str):
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image, CLIENT_PATH: where}


def input_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: messages, function calls (grouped into one assistant turn) and their outputs."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer; got {role!r}",
                                  f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) for v in (name, args, call_id)):
                raise bad_request(f"{where}: a function_call needs string name, arguments and call_id", where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{where}.call_id must be a string", f"{where}.call_id")
            content = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            continue  # this server's models give no reasoning items; a client may send another's back
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                              f"function_call_output)", f"{where}.type")
    return messages


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}]: only function tools ({{'type': 'function', 'name': ...}}) are supported"
                              + (f", not {kind!r}" if kind else ""), f"tools[{i}]")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt  # text, json_object: the same names as chat's response_format


def chat_request(body: dict[str, Any], history: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    """The chat-completion request for ``body``, after the conversation so far (``history``)."""
    messages = list(history)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    if "input" not in body:
        raise bad_request("input is required", "input")
    messages += input_messages(body["input"])
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": stream}
    if stream:
        chat["stream_options"] = {"include_usage": True}
    for key in _PASSED:
        if body.get(key) is not None:
            chat[key] = body[key]
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad_request("reasoning must be an object like {'effort': 'low'}", "reasoning")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
    elif body.get("tool_choice") not in (None, "none", "auto"):
        raise bad_request("tool_choice needs tools", "tool_choice")
    return finish_chat_request(chat, body, _response_format(body.get("text")))
