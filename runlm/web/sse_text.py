"""JSON for one server-sent event's ``data:`` line, shared by every stream both servers write."""
from __future__ import annotations

import json
from typing import Any

# characters that str.splitlines (httpx's line reader, the daemon's proxy) ends a line at; json.dumps escapes
# every other one, but not these three when it keeps non-ASCII text as it is
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
