"""What every tool-call format is: a scanner of (possibly still growing) text into content and calls."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from runlm.tools.json_scan import PartialCall


@dataclass(slots=True)
class ToolScan:
    content: str
    calls: list[PartialCall]


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_back(text: str, marker: str) -> str:
    """``text`` minus a tail that could be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


class ToolParser:
    name = "base"
    needs_special_tokens = False  # the call markers are special tokens the detokenizer would drop

    def scan(self, text: str, final: bool) -> ToolScan:
        raise NotImplementedError


def no_calls(text: str, marker: str, final: bool) -> ToolScan:
    """The scan of text in which a format's call ``marker`` does not occur: all content (while streaming, less a tail
    that may still become the marker)."""
    return ToolScan(text if final else held_back(text, marker), [])
