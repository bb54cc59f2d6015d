"""StructuredOutputsParams: what the output must match (vLLM's names: json, regex, choice, grammar...).

Exactly one constraint per request. The checks here are about shape (types, exactly one kind);
whether a schema, regex or grammar is valid is decided when it is compiled (``compiler.py``),
before the request is admitted.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from runlm.engine.types.errors import SamplingParamsError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(SamplingParamsError):
    """An invalid constraint; ``param`` names the field at fault (e.g. ``structured_outputs.json``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(param, message)
        self.message = message


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None           # a JSON schema (object or its text)
    json_object: bool | None = None          # any JSON object
    regex: str | None = None
    choice: list[str] | None = None          # exactly one of these strings
    grammar: str | None = None               # a context-free grammar: Lark or GBNF (llama.cpp)
    disable_any_whitespace: bool = False     # JSON: compact, no whitespace between tokens
    disable_additional_properties: bool = False  # JSON: objects get only the properties the schema names
    whitespace_pattern: str | None = None    # JSON: a regex for the whitespace allowed between tokens

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StructuredOutputsParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StructuredOutputsError(f"structured_outputs.{unknown[0]}",
                                         f"unknown field; expected one of {', '.join(KINDS)}")
        return cls(**{k: v for k, v in data.items() if v is not None})

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        def bad(field: str, message: str) -> None:
            raise StructuredOutputsError(f"structured_outputs.{field}", message)

        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none was given" if not given else f"got {', '.join(given)}"
            bad(given[1] if len(given) > 1 else "json", f"set exactly one of {', '.join(KINDS)}; {what}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as exc:
                    bad("json", f"the schema is not valid JSON: {exc}")
            if not isinstance(self.json, (dict, bool)):
                bad("json", f"a JSON schema is an object, got {type(self.json).__name__}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            bad("json_object", "must be true or false")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            bad("regex", "must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            bad("grammar", "must be a non-empty string (Lark or GBNF)")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            bad("choice", "must be a non-empty list of non-empty strings")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            bad("whitespace_pattern", "must be a regex string")

    def key(self) -> tuple[Any, ...]:
        """What identifies the compiled grammar (for the compile cache)."""
        spec = getattr(self, self.kind)
        if isinstance(spec, (dict, list, bool)):
            spec = json.dumps(spec, sort_keys=True)
        return (self.kind, spec, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)


def coerce_structured_outputs(value: Any) -> StructuredOutputsParams:
    if isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, Mapping):
        return StructuredOutputsParams.from_dict(value)
    raise StructuredOutputsError("structured_outputs", f"expected an object, got {type(value).__name__}")
