"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` chunks, then ``data: [DONE]``."""
from __future__ import annotations

import json
from typing import Any

from runlm.server.errors import APIError

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# characters that str.splitlines (httpx's line reader, the daemon's proxy) ends a line at; json.dumps escapes
# every other one, but not these three when it keeps non-ASCII text as it is
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event(payload: dict[str, Any]) -> str:
    text = json.dumps(payload, ensure_ascii=False, separators=(',', ':')).translate(_LINE_BREAKS)
    return f"data: {text}\n\n"


def error_event(exc: APIError) -> str:
    """An error after the stream has started (the status line is already sent): OpenAI's error shape."""
    return event(exc.body())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
