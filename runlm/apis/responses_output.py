"""Chat-completion answers as Responses: the whole ``response`` object, and a chat stream as the typed event
sequence (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from runlm.apis.source import ChunkTranslator


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
        else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


@dataclass(slots=True)
class ResponseShell:
    """What a response says about its request, whatever its output."""
    id: str
    model: str
    body: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))

    def build(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              finish_reason: str | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = status == "completed" and finish_reason == "length"
        text = b["text"] if isinstance(b.get("text"), dict) else {}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": "incomplete" if incomplete else status,
            "completed_at": int(time.time()) if status == "completed" and not incomplete else None,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "model": self.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"), "reasoning": None,
            "store": b.get("store", True) is not False, "temperature": b.get("temperature"),
            "text": {"format": text.get("format") or {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "top_p": b.get("top_p"), "truncation": "disabled", "usage": usage,
            "metadata": b.get("metadata") or {}, "user": None,
        }


def whole_response(shell: ResponseShell, chat: dict[str, Any]) -> dict[str, Any]:
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append(message_item(new_id("msg"), message.get("content") or ""))
    for call in calls:
        output.append(call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    return shell.build("completed", output, _usage(chat.get("usage")), choice.get("finish_reason"))


@dataclass(slots=True)
class _OpenItem:
    index: int
    item: dict[str, Any]
    text: str = ""


class ResponseEvents(ChunkTranslator):
    """Chat chunks in, Responses events out (each a dict with its ``type`` and ``sequence_number``)."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.message: _OpenItem | None = None
        self.reasoning: _OpenItem | None = None
        self.calls: dict[int, _OpenItem] = {}   # the chat delta's tool-call index -> its open item
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self, model: str) -> list[dict[str, Any]]:
        self.shell.model = model
        created = self.shell.build("in_progress", [])
        return [self._event("response.created", response=created),
                self._event("response.in_progress", response=created)]

    def _open(self, item: dict[str, Any]) -> tuple[_OpenItem, dict[str, Any]]:
        opened = _OpenItem(len(self.output), item)
        self.output.append(item)
        return opened, self._event("response.output_item.added", output_index=opened.index, item=dict(item))

    def _close_message(self) -> list[dict[str, Any]]:
        m = self.message
        if m is None:
            return []
        self.message = None
        done = message_item(m.item["id"], m.text)
        self.output[m.index] = done
        part = done["content"][0]
        where = {"item_id": m.item["id"], "output_index": m.index}
        return [self._event("response.output_text.done", content_index=0, text=m.text, logprobs=[], **where),
                self._event("response.content_part.done", content_index=0, part=part, **where),
                self._event("response.output_item.done", output_index=m.index, item=done)]

    def _close_reasoning(self) -> list[dict[str, Any]]:
        r = self.reasoning
        if r is None:
            return []
        self.reasoning = None
        done = reasoning_item(r.item["id"], r.text)
        self.output[r.index] = done
        where = {"item_id": r.item["id"], "output_index": r.index}
        return [self._event("response.reasoning_text.done", content_index=0, text=r.text, **where),
                self._event("response.content_part.done", content_index=0, part=done["content"][0], **where),
                self._event("response.output_item.done", output_index=r.index, item=done)]

    def on_reasoning(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.reasoning is None:
            self.reasoning, added = self._open(reasoning_item(new_id("rs"), "", "in_progress"))
            events += [added, self._event("response.content_part.added", item_id=self.reasoning.item["id"],
                                          output_index=self.reasoning.index, content_index=0,
                                          part={"type": "reasoning_text", "text": ""})]
        self.reasoning.text += text
        events.append(self._event("response.reasoning_text.delta", item_id=self.reasoning.item["id"],
                                  output_index=self.reasoning.index, content_index=0, delta=text))
        return events

    def _close_calls(self) -> list[dict[str, Any]]:
        events = []
        for c in self.calls.values():
            done = call_item(c.item["id"], c.item["call_id"], c.item["name"], c.text)
            self.output[c.index] = done
            events += [self._event("response.function_call_arguments.done", item_id=done["id"],
                                   output_index=c.index, name=done["name"], arguments=c.text),
                       self._event("response.output_item.done", output_index=c.index, item=done)]
        self.calls = {}
        return events

    def on_text(self, text: str) -> list[dict[str, Any]]:
        events = self._close_reasoning()
        if self.message is None:
            self.message, added = self._open(message_item(new_id("msg"), "", "in_progress"))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += [added, self._event("response.content_part.added", item_id=self.message.item["id"],
                                          output_index=self.message.index, content_index=0, part=part)]
        self.message.text += text
        events.append(self._event("response.output_text.delta", item_id=self.message.item["id"],
                                  output_index=self.message.index, content_index=0, delta=text, logprobs=[]))
        return events

    def on_call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        index = delta.get("index", 0)
        fn = delta.get("function") or {}
        if index not in self.calls:
            events += self._close_reasoning() + self._close_message()
            item = call_item(new_id("fc"), delta.get("id") or new_id("call"), fn.get("name") or "", "",
                             "in_progress")
            self.calls[index], added = self._open(item)
            events.append(added)
        call = self.calls[index]
        if fn.get("arguments"):
            call.text += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=call.item["id"],
                                      output_index=call.index, delta=fn["arguments"]))
        return events

    def on_finish(self, reason: str, matched: Any) -> None:
        self.finish_reason = reason

    def finish(self) -> list[dict[str, Any]]:
        events = self._close_reasoning() + self._close_message() + self._close_calls()
        # an empty answer is still one (empty) message, as the whole answer has
        if not any(item["type"] != "reasoning" for item in self.output):
            self.message, added = self._open(message_item(new_id("msg"), "", "in_progress"))
            events += [added] + self._close_message()
        final = self.shell.build("completed", self.output, _usage(self.usage), self.finish_reason)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=final)]

    def failed(self, message: str, code: str | None) -> list[dict[str, Any]]:
        final = self.shell.build("failed", self.output)
        final["error"] = {"code": code or "server_error", "message": message}
        return [self._event("error", code=code, message=message, param=None),
                self._event("response.failed", response=final)]
