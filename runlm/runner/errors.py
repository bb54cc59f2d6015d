"""Errors the runner's APIs answer with: an HTTP status and the OpenAI error shape."""
from __future__ import annotations

from typing import Any

from runlm.openai_error import error_body

__all__ = ["BackendUnavailable", "BadRequest", "Busy", "Conflict", "ModelTooLarge", "NotFound", "RunnerError",
           "error_body"]


class RunnerError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class BadRequest(RunnerError):
    status, type = 400, "invalid_request_error"


class NotFound(RunnerError):
    status, type = 404, "not_found_error"


class Conflict(RunnerError):
    status, type = 409, "conflict_error"


class ModelTooLarge(RunnerError):
    """The model needs more memory than the whole budget: refused before anything starts."""
    status, type = 507, "insufficient_memory"


class Busy(RunnerError):
    """Every loaded model is in use and none can make room; try again."""
    status, type = 503, "server_busy"


class BackendUnavailable(RunnerError):
    """The backend is not installed, failed to start, or died while answering."""
    status, type = 503, "backend_error"

