"""An Anthropic Messages request (``POST /v1/messages``) as the chat-completion request that answers it:
``system``, content blocks (text, ``tool_use``, ``tool_result``), ``max_tokens``, ``stop_sequences``,
``tools`` and ``tool_choice`` map onto chat completions' own fields, so prompts, tool calls and sampling
are the chat path's. ``image`` blocks (base64, or a URL the server may be allowed to fetch) become chat's
``image_url`` parts in their place among the text; documents and server tools are refused by name."""
from __future__ import annotations

import json
from typing import Any

from runlm.apis.source import CLIENT_PATH, bad_request, finish_chat_request

# chat-completion field -> the Anthropic field the client sent, to name it in errors
PARAM_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "messages": "messages",
               "response_format": "output_config.format",
               "response_format.json_schema.schema": "output_config.format.schema"}
_PASSED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop_sequences": "stop"}


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}.text must be a string", f"{where}.text")
    return block["text"]


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", where)
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise bad_request(f"{where}[{j}] must be a content block object", f"{where}[{j}]")
    return content


def _tool_result_content(block: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
    """A tool_result's content: its text, or (where it holds images) its text and image parts in order, so an
    image a tool returns reaches a vision model and is refused by a text-only one as a user's image is."""
    content = block.get("content", "")
    error = "Error: " if block.get("is_error") else ""
    if isinstance(content, str):
        return error + content
    parts: list[dict[str, Any]] = [{"type": "text", "text": error}] if error else []
    for k, b in enumerate(_blocks(content, f"{where}.content")):
        if b.get("type") == "text":
            parts.append({"type": "text", "text": _text(b, f"{where}.content[{k}]")})
        elif b.get("type") == "image":
            parts.append(_image(b, f"{where}.content[{k}]"))
        else:
            raise bad_request(f"{where}.content[{k}]: a tool result holds text and image blocks, not "
                              f"{b.get('type')!r}", f"{where}.content[{k}].type")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``image`` block as chat's ``image_url`` part: ``source`` {type: base64, media_type, data} becomes a data:
    URL; {type: url, url} is passed on (the server fetches it only from hosts it was told to)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in MEDIA_TYPES:
            raise bad_request(f"{where}.source.media_type must be one of {', '.join(MEDIA_TYPES)}; got "
                              f"{media_type!r}", f"{where}.source.media_type")
        if not isinstance(data, str) or not data:
            raise bad_request(f"{where}.source.data must be the image as a base64 string", f"{where}.source.data")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}, CLIENT_PATH: where}
    if kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}, CLIENT_PATH: where}
    raise bad_request(f"{where}.source must be {{'type': 'base64', 'media_type': 'image/png', 'data': ...}} or "
                      f"{{'type': 'url', 'url': ...}}", f"{where}.source")


def _joined(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Text and image parts in order, adjacent texts joined with newlines (as a text-only message's are)."""
    out: list[dict[str, Any]] = []
    for part in parts:
        if part["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + "\n" + part["text"]}
        else:
            out.append(part)
    return out


def _message(i: int, msg: Any) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become ``tool`` messages, tool uses tool_calls."""
    where = f"messages[{i}]"
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise bad_request(f"{where}.role must be 'user' or 'assistant'", f"{where}.role")
    role = msg["role"]
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # the user's text and images in order, once an image is among them
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(msg.get("content"), f"{where}.content")):
        at, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "text":
            texts.append(_text(block, at))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image" and role == "user":
            parts.append(_image(block, at))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{at}: a tool_use block needs string id and name", at)
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{at}.tool_use_id must be a string", f"{at}.tool_use_id")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _tool_result_content(block, at)})
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])  # the template may show it again (Qwen3's reasoning_content)
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind in ("document", "search_result"):
            raise bad_request(f"{at}: {kind} blocks are not supported (runlm's models take text and images)", at)
        else:
            raise bad_request(f"{at}: {kind!r} blocks are not supported in {role} messages", f"{at}.type")
    out: list[dict[str, Any]] = results
    if role == "assistant":
        out.append({"role": "assistant", "content": "".join(texts) or None, **({"tool_calls": calls} if calls else {}),
                    **({"reasoning_content": "".join(thinking)} if thinking else {})})
    elif any(p["type"] == "image_url" for p in parts):
        out.append({"role": "user", "content": _joined(parts)})
    elif texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _system(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n".join(_text(b, f"system[{k}]") for k, b in enumerate(_blocks(system, "system")))
    raise bad_request("system must be a string or a list of text blocks", "system")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        custom = isinstance(tool, dict) and tool.get("type", "custom") == "custom"
        if not custom or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}]: only custom tools ({{'name', 'description', 'input_schema'}}) are "
                              f"supported", f"tools[{i}]")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    if not isinstance(choice, dict):
        raise bad_request("tool_choice must be an object like {'type': 'auto'}", "tool_choice")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise bad_request(f"tool_choice.type must be auto, any, tool or none; got {kind!r}", "tool_choice.type")


def _output_format(config: Any) -> dict[str, Any] | None:
    """``output_config.format`` (Anthropic's structured outputs) as chat's response_format."""
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
        raise bad_request("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                          "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _thinking(config: Any) -> dict[str, Any]:
    """``thinking`` ({"type": "enabled", "budget_tokens": N}, or "disabled") as chat's reasoning fields."""
    if config is None:
        return {}
    kind = config.get("type") if isinstance(config, dict) else None
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}, "include_reasoning": False}
    if kind == "adaptive":
        return {}
    budget = config.get("budget_tokens") if kind == "enabled" else None
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise bad_request("thinking must be {'type': 'enabled', 'budget_tokens': N}, {'type': 'adaptive'} or "
                          "{'type': 'disabled'}", "thinking")
    return {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": budget}


def chat_request(body: dict[str, Any], stream: bool = False, counting: bool = False) -> dict[str, Any]:
    """The chat-completion request for ``body`` (``counting``: for count_tokens, which needs no max_tokens)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    chat_messages = [m for i, msg in enumerate(messages) for m in _message(i, msg)]
    system = _system(body.get("system"))
    if system:
        chat_messages.insert(0, {"role": "system", "content": system})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": chat_messages}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if counting:
        return chat
    if "max_tokens" not in body:
        raise bad_request("max_tokens is required", "max_tokens")
    chat["max_completion_tokens"] = body["max_tokens"]
    chat["stream"] = stream
    if stream:
        # usage in every chunk: message_start reports the prompt's tokens before any output (vLLM's option)
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    for key, chat_key in _PASSED.items():
        if body.get(key) is not None:
            chat[chat_key] = body[key]
    chat.update(_thinking(body.get("thinking")))
    if chat_messages[-1]["role"] == "assistant":  # a prefilled answer: the model goes on from it
        chat.update(add_generation_prompt=False, continue_final_message=True)
    if body.get("tool_choice") is not None:
        choice, parallel = _tool_choice(body["tool_choice"])
        if "tools" in chat:
            chat["tool_choice"] = choice
        elif choice not in ("auto", "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        if parallel is not None and "tools" in chat:
            chat["parallel_tool_calls"] = parallel
    return finish_chat_request(chat, body, _output_format(body.get("output_config")))
