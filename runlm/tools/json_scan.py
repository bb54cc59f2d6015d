"""Reading tool-call JSON that may still be arriving: ``{"name": ..., "arguments": {...}}`` objects.

A streamed call is read again from its start on every delta (calls are short), and what is read
only ever grows: the name once its string is closed, the arguments as raw JSON text up to the
last character seen. So the streamed argument deltas add up to exactly the raw text the finished
call holds, which is what the whole (non-streamed) response returns.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/Mistral say arguments, Llama 3 says parameters
_WS = " \t\r\n"


@dataclass(slots=True)
class PartialCall:
    name: str | None = None
    arguments: str = ""          # raw JSON text of the arguments value, as far as it has arrived
    arguments_done: bool = False
    done: bool = False           # the call's object is closed
    end: int = 0                 # index just past what was read
    arguments_is_string: bool = False  # arguments given as a JSON string holding JSON

    @property
    def valid(self) -> bool:
        """Finished, named, and with arguments that are a JSON object."""
        if not (self.done and self.name and self.arguments_done):
            return False
        try:
            return isinstance(json.loads(self.final_arguments), dict)
        except ValueError:
            return False

    @property
    def final_arguments(self) -> str:
        if not self.arguments_done:
            return self.arguments
        if self.arguments_is_string:
            return json.loads(self.arguments)
        return self.arguments


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_value(text: str, i: int) -> tuple[int, bool]:
    """End of the JSON value starting at text[i], and whether it is complete."""
    if i >= len(text):
        return i, False
    c = text[i]
    if c == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1, True
            j += 1
        return len(text), False
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < len(text):
            ch = text[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1, True
            j += 1
        return len(text), False
    j = i  # number, true, false, null: complete once something follows it
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j, j < len(text)


def scan_call(text: str, i: int) -> PartialCall:
    """Read the call object whose ``{`` is at text[i]."""
    call = PartialCall(end=i)
    pos = i + 1
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text):
            return call
        if text[pos] == "}":
            call.done, call.end = True, pos + 1
            return call
        if text[pos] == ",":
            pos += 1
            continue
        key_end, ok = scan_value(text, pos)
        if not ok or text[pos] != '"':
            return call
        key = json.loads(text[pos:key_end])
        pos = skip_ws(text, key_end)
        if pos >= len(text) or text[pos] != ":":
            return call
        pos = skip_ws(text, pos + 1)
        value_end, complete = scan_value(text, pos)
        if key == "name" and complete and text[pos] == '"':
            call.name = json.loads(text[pos:value_end])
        elif key in ARGUMENT_KEYS and pos < len(text):
            call.arguments, call.arguments_done = text[pos:value_end], complete
            call.arguments_is_string = text[pos] == '"'
        call.end = value_end
        if not complete:
            return call
        pos = value_end


def scan_calls(text: str, i: int, separators: str = ",;") -> tuple[list[PartialCall], int]:
    """Consecutive call objects from text[i] (an array's items, or ``;``-separated): the calls and where
    reading stopped."""
    calls: list[PartialCall] = []
    pos = i
    while True:
        pos = skip_ws(text, pos)
        if pos < len(text) and calls and text[pos] in separators:
            pos = skip_ws(text, pos + 1)
        if pos >= len(text) or text[pos] != "{":
            return calls, pos
        call = scan_call(text, pos)
        calls.append(call)
        if not call.done:
            return calls, len(text)
        pos = call.end
