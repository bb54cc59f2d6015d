"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` chunks, then ``data: [DONE]``."""
from __future__ import annotations

from typing import Any

from runlm.server.errors import APIError
from runlm.web.sse_text import sse_json

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> str:
    return f"data: {sse_json(payload)}\n\n"


def error_event(exc: APIError) -> str:
    """An error after the stream has started (the status line is already sent): OpenAI's error shape."""
    return event(exc.body())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
