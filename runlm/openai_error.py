"""OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``: one definition for the
engine server (runlm/server) and the runner (runlm/runner), whose clients parse the same shape."""
from __future__ import annotations

from typing import Any


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
