"""Chat-completion answers as Anthropic Messages: the whole ``message``, a chat stream as Anthropic's events
(``message_start``, ``content_block_start/delta/stop``, ``message_delta``, ``message_stop``), and errors in
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Scope

from runlm.apis.responses_output import new_id
from runlm.apis.source import ChunkTranslator
from runlm.web.asgi import openai_error_json

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path.endswith("/v1/messages") or path.endswith("/v1/messages/count_tokens")


def middleware_error(scope: Scope, status: int, message: str, code: str) -> bytes:
    """serve-engine's middleware errors (API key, body size): Anthropic's shape on its routes, OpenAI's elsewhere."""
    if is_anthropic_path(scope["path"]):
        return json.dumps(error_body(status, message)).encode()
    return openai_error_json(scope, status, message, code)


def stop_reason(finish: str | None, matched: Any, stop_sequences: list[str]) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat finish_reason (and vLLM's matched stop_reason)."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if finish is None:
        return None, None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:  # a call cut short by max_tokens: what there is, so nothing is lost
        return {"_raw_arguments": arguments}


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    u = chat_usage or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u.get("prompt_tokens", 0), "output_tokens": u.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _message(msg_id: str, model: str, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
             usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage}


def whole_message(chat: dict[str, Any], model: str, stop_sequences: list[str]) -> dict[str, Any]:
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _input(call["function"]["arguments"])})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences)
    return _message(new_id("msg"), chat.get("model") or model, content, reason, sequence, _usage(chat.get("usage")))


@dataclass(slots=True)
class MessageEvents(ChunkTranslator):
    """Chat chunks in, Anthropic events out (each a dict whose ``type`` is the SSE event name)."""
    model: str
    stop_sequences: list[str]
    msg_id: str = field(default_factory=lambda: new_id("msg"))
    block: int = -1                # the open content block's index (-1: none)
    block_kind: str | None = None  # "thinking", "text" or the chat tool-call index of the open tool_use block
    calls: set[int] = field(default_factory=set)
    finish_reason: str | None = None
    matched: Any = None
    usage: dict[str, Any] | None = None

    def start(self, model: str) -> list[dict[str, Any]]:
        self.model = model
        # the first chunk's usage (continuous usage stats) counts the prompt; 0 from a backend that sends none
        return [{"type": "message_start",
                 "message": _message(self.msg_id, self.model, [], None, None, _usage(self.usage))},
                {"type": "ping"}]

    def _close(self) -> list[dict[str, Any]]:
        if self.block_kind is None:
            return []
        events = [{"type": "content_block_delta", "index": self.block,  # runlm's thinking is not signed
                   "delta": {"type": "signature_delta", "signature": ""}}] if self.block_kind == "thinking" else []
        self.block_kind = None
        return events + [{"type": "content_block_stop", "index": self.block}]

    def _open(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.block += 1
        self.block_kind = kind
        return events + [{"type": "content_block_start", "index": self.block, "content_block": block}]

    def on_text(self, text: str) -> list[dict[str, Any]]:
        events = self._open("text", {"type": "text", "text": ""}) if self.block_kind != "text" else []
        return events + [{"type": "content_block_delta", "index": self.block,
                          "delta": {"type": "text_delta", "text": text}}]

    def on_reasoning(self, text: str) -> list[dict[str, Any]]:
        events = [] if self.block_kind == "thinking" else \
            self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        return events + [{"type": "content_block_delta", "index": self.block,
                          "delta": {"type": "thinking_delta", "thinking": text}}]

    def on_call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        index, fn = delta.get("index", 0), delta.get("function") or {}
        events = []
        if index not in self.calls:
            self.calls.add(index)
            events += self._open(f"tool{index}", {"type": "tool_use", "id": delta.get("id") or new_id("toolu"),
                                                  "name": fn.get("name") or "", "input": {}})
        if fn.get("arguments"):
            events.append({"type": "content_block_delta", "index": self.block,
                           "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}})
        return events

    def on_finish(self, reason: str, matched: Any) -> None:
        self.finish_reason, self.matched = reason, matched

    def finish(self) -> list[dict[str, Any]]:
        reason, sequence = stop_reason(self.finish_reason or "stop", self.matched, self.stop_sequences)
        usage = _usage(self.usage)
        return self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage},
            {"type": "message_stop"}]
