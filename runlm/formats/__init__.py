"""Readers for model files: GGUF, safetensors, tokenizers and chat templates."""
from __future__ import annotations


class ModelFormatError(ValueError):
    """A model file is truncated, corrupt or uses something runlm cannot read.

    The message always names the file and, where one is at fault, the tensor.
    """


class LoRAError(ValueError):
    """An adapter that cannot be read or applied to this model; the message names the adapter and module.

    Here, with no torch behind it, so the engine's error types import without the model code."""
