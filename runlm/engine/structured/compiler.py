"""From StructuredOutputsParams to a checked llguidance grammar, cached by the constraint's key.

llguidance was chosen over xgrammar because, measured here on SmolLM2's 49k vocabulary
(bench/structured_bench.py --backends), it compiles a JSON schema in ~1 ms instead of
~150 ms, computes a step's mask faster (~90 us vs ~125 us mean), and installs in 7 MB
without triton.
"""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any

import llguidance

from runlm.engine.types.structured_params import StructuredOutputsError, StructuredOutputsParams

# JSON whitespace between tokens when the request does not say: at most one newline plus
# indentation. Unbounded whitespace lets a small model pad forever and never finish.
DEFAULT_WHITESPACE = r"[ \t]{0,4}(\n[ \t]{0,24})?"
_CACHE_SIZE = 256


def _no_additional_properties(schema: Any) -> Any:
    """Every object schema that does not say otherwise gets additionalProperties: false."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _json_options(p: StructuredOutputsParams) -> dict[str, Any]:
    if p.disable_any_whitespace:
        return {"whitespace_flexible": False}
    return {"whitespace_flexible": True, "whitespace_pattern": p.whitespace_pattern or DEFAULT_WHITESPACE}


def grammar_text(p: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``p`` (unchecked)."""
    kind = p.kind
    try:
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else p.json
            if p.disable_additional_properties:
                schema = _no_additional_properties(copy.deepcopy(schema))
            # the options are llguidance's JsonCompileOptions keys, built as a plain dict
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(p))  # type: ignore[arg-type]
        # kind names the one field that is set
        if kind == "regex":
            assert p.regex is not None
            return llguidance.LLMatcher.grammar_from_regex(p.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", p.choice)  # type: ignore[arg-type]  # a list works; the stub says str
        assert p.grammar is not None
        return llguidance.grammar_from("gbnf", p.grammar)  # Lark passes through unchanged
    except (ValueError, TypeError) as exc:
        raise StructuredOutputsError(f"structured_outputs.{kind}", str(exc)) from None


class GrammarCompiler:
    """Checks each constraint against the model's tokenizer once; later requests reuse the result.
    Thread-safe: a server compiles up front on a worker thread while the engine thread runs."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, limits: llguidance.LLParserLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits or llguidance.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[tuple, str] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, p: StructuredOutputsParams) -> str:
        key = p.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        grammar = grammar_text(p)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer,
                                                                                limits=self.limits)
        if is_error:
            raise StructuredOutputsError(f"structured_outputs.{p.kind}", _first_line(messages))
        with self._lock:
            self._cache[key] = grammar
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if m.is_error():  # compile() checked the grammar, so only resource limits get here
            raise StructuredOutputsError("structured_outputs", m.get_error())
        return m


def _first_line(messages: list[str]) -> str:
    text = (messages[0] if messages else "invalid grammar").strip()
    return text.splitlines()[0] if "\n" in text and len(text) > 300 else text
