"""``collective_rpc``'s lookup: a named public method of the engine core (vLLM runs a worker method by
name on every worker; here every replica's engine core). Private names and attributes that are not
methods are refused, so a name from a caller reaches only the engine's public surface."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["engine_method"]


def engine_method(engine: Any, method: str) -> Callable[..., Any]:
    if not isinstance(method, str) or not method.isidentifier() or method.startswith("_"):
        raise ValueError(f"collective_rpc takes the name of a public engine method, not {method!r}")
    fn = getattr(engine, method, None)
    if not callable(fn):
        raise ValueError(f"the engine ({type(engine).__name__}) has no method {method!r}")
    return fn
