"""The engine's typed errors: raised when a request is added, before it is queued, so a caller (the
HTTP server, LLM) can answer them before any output. The engine is their one owner; the server only
maps them to HTTP (runlm/server/generation.py)."""
from __future__ import annotations

from runlm.formats import LoRAError  # an adapter that cannot be loaded or applied (a ValueError)

__all__ = ["EngineDeadError", "LoRAError", "PromptError", "PromptTooLongError", "SamplingParamsError", "TaskError"]


class SamplingParamsError(ValueError):
    """An invalid sampling value; ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.detail = param, message

    def __reduce__(self) -> tuple:  # re-raised unchanged across a replica's process boundary
        return type(self), (self.param, self.detail)


class PromptError(ValueError):
    """A prompt the engine cannot take: empty, too long for the context, or with unknown token ids."""


class PromptTooLongError(PromptError):
    """The prompt does not fit the model's context (both numbers are in the message)."""

    def __init__(self, message: str, num_tokens: int, max_model_len: int) -> None:
        super().__init__(message)
        self.num_tokens, self.max_model_len = num_tokens, max_model_len

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.num_tokens, self.max_model_len)


class TaskError(ValueError):
    """The request asks a model for something it cannot do (text from an embedder, vectors from a chat model)."""


class EngineDeadError(RuntimeError):
    """The engine thread died; every request fails and check_health() raises."""


class StepOutOfMemoryError(RuntimeError):
    """A step ran out of memory (the GPU's, or the host's allocator refused): the requests the engine dropped so the
    others could go on fail with this; the engine keeps serving."""
