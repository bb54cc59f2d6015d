"""Structured outputs: constrained decoding with llguidance (JSON schema, regex, choice, grammar)."""
from __future__ import annotations

from runlm.engine.types.structured_params import StructuredOutputsError, StructuredOutputsParams

__all__ = ["StructuredOutputsError", "StructuredOutputsParams"]
