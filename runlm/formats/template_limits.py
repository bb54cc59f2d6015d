"""Bounds on rendering a Jinja template whose source or inputs may come from a client.

The sandbox stops templates from reaching Python internals, but not from spending time or memory:
nested ``range()`` loops run for hours, ``'x' * 10**11`` or ``'x'|center(10**11)`` allocate without
limit. Here every render gets a deadline and a size: sizes are checked *before* the operator or
call that would allocate them (``*``, ``+``, ``**``, ``%``, integer arguments to calls and filters),
and the deadline is checked at each call, filter, ``range`` step and chunk of output. A loop with
no call in it is not seen here; a server stops those from outside (runlm/server/render.py).
"""
from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from jinja2.exceptions import SecurityError
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

MAX_CHARS = 32 << 20     # the longest string (or list) a render may build, and its longest output
MAX_EXPONENT = 4096      # integer powers past this are CPU sinks, not templating
RENDER_SECONDS = 5.0     # a render's default deadline
# format specs with a width or precision of a million or more: '%9999999s', '{:>9999999}'
_BIG_PERCENT = re.compile(r"%[-+ #0]*(\*|\d{7,}|\d*\.\d{7,})")
_BIG_BRACE = re.compile(r"\{[^{}]*:[^{}]*\d{7,}")


class RenderLimitError(SecurityError):
    """A render that ran past its deadline or would build too large a value."""


class _Deadline(threading.local):
    at: float | None = None


_deadline = _Deadline()


def check_deadline() -> None:
    at = _deadline.at
    if at is not None and time.monotonic() > at:
        raise RenderLimitError("the chat template took too long to render")


def _check_size(n: int) -> None:
    if n > MAX_CHARS:
        raise RenderLimitError(f"the chat template would build a value of {n} items (the limit is {MAX_CHARS})")


def _check_args(args: tuple, kwargs: dict) -> None:
    check_deadline()
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_CHARS:
            raise RenderLimitError(f"the chat template passes {a} to a call (the limit is {MAX_CHARS})")


def _check_format(spec: str, pattern: re.Pattern) -> None:
    if pattern.search(spec):
        raise RenderLimitError("the chat template formats with a width of a million characters or more")


def _bounded_filter(fn: Callable) -> Callable:
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_environment markers
    def call(*args: Any, **kwargs: Any) -> Any:
        _check_args(args[1:], kwargs)  # the first is the value filtered (or the context/environment)
        return fn(*args, **kwargs)
    return call


def _bounded_range(*args: int) -> Iterator[int]:
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise RenderLimitError(f"range() of {len(r)} items (the limit is {MAX_RANGE})")
    for i in r:
        if i & 255 == 0:
            check_deadline()
        yield i


def _sized(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple)) else None


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with sizes checked before they are allocated and a deadline at every call."""
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}
        self.globals["range"] = _bounded_range

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check_deadline()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                size = _sized(seq)
                if size is not None and isinstance(times, int):
                    _check_size(size * times)
        elif operator == "+" and (a := _sized(left)) is not None and (b := _sized(right)) is not None:
            _check_size(a + b)
        elif operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise RenderLimitError(f"the chat template raises to the power {right} (the limit is {MAX_EXPONENT})")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, _BIG_PERCENT)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_args(args, kwargs)
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # the sandbox wraps str.format
        if isinstance(owner, str) and getattr(__obj, "__name__", "") in ("format", "format_map"):
            _check_format(owner, _BIG_BRACE)
        return super().call(__context, __obj, *args, **kwargs)


def bounded_output(chunks: Iterator[str], seconds: float | None) -> str:
    """Join a template's output as it is generated, within the deadline and MAX_CHARS."""
    previous = _deadline.at
    _deadline.at = None if seconds is None else time.monotonic() + seconds
    try:
        out, size = [], 0
        for chunk in chunks:
            size += len(chunk)
            _check_size(size)
            check_deadline()
            out.append(chunk)
        return "".join(out)
    finally:
        _deadline.at = previous
