"""Tool calls streamed the way OpenAI streams them.

The first delta of call i is ``{"index": i, "id", "type": "function", "function": {"name",
"arguments": ""}}``; later ones are ``{"index": i, "function": {"arguments": "<more>"}}``. Joined,
the argument pieces are exactly the arguments the whole response returns (see json_scan).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runlm.tools.json_scan import PartialCall
from runlm.tools.parsers import ToolParser, new_call_id


@dataclass(slots=True)
class _Sent:
    id: str = field(default_factory=new_call_id)
    header: bool = False
    arguments: int = 0


def _arguments_so_far(call: PartialCall) -> str:
    if call.arguments_is_string:  # a JSON string that holds JSON: only its decoded text is the arguments
        return call.final_arguments if call.arguments_done else ""
    return call.arguments


class ToolCallStreamer:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._content_sent = 0
        self._calls: list[_Sent] = []

    @property
    def num_calls(self) -> int:
        return sum(s.header for s in self._calls)

    def push(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Add generated text; returns (content delta, tool-call deltas). ``final`` on the last push."""
        self.text += delta
        scan = self.parser.scan(self.text, final)
        content = scan.content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(scan.content))
        out: list[dict[str, Any]] = []
        for i, call in enumerate(scan.calls):
            if i == len(self._calls):
                self._calls.append(_Sent())
            sent = self._calls[i]
            if not sent.header:
                if not call.name:
                    break  # calls go out in order: a later one waits for this one's name
                sent.header = True
                out.append({"index": i, "id": sent.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            args = _arguments_so_far(call)
            if len(args) > sent.arguments:
                out.append({"index": i, "function": {"arguments": args[sent.arguments:]}})
                sent.arguments = len(args)
        return content, out
