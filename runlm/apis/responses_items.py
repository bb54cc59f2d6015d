"""A response's input items (``GET /v1/responses/{id}/input_items``): the request's ``input`` as OpenAI lists it,
each item with an id, paged by ``limit``, ``order`` and ``after`` in OpenAI's list shape."""
from __future__ import annotations

from typing import Any

from runlm.apis.responses_output import call_item, message_item, new_id
from runlm.apis.source import ProtocolError, bad_request

MAX_LIMIT = 100
DEFAULT_LIMIT = 20


def _parts(content: Any, kind: str) -> list[dict[str, Any]]:
    """Message content (already checked by responses_request) as content parts of ``kind``; images as the client
    sent them (``input_image``)."""
    if isinstance(content, str):
        return [{"type": kind, "text": content}]
    return [{"type": kind, "text": p["text"]} if "text" in p else
            {k: v for k, v in p.items() if k in ("type", "image_url", "detail", "file_id")}
            for p in content if isinstance(p, dict) and ("text" in p or p.get("type") == "input_image")]


def input_items(items: Any) -> list[dict[str, Any]]:
    """``input`` (a string or a list of items, already checked) as the items input_items lists, in order."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            parts = _parts(item.get("content"), "output_text")
            out.append(message_item(item.get("id") or new_id("msg"), "".join(p.get("text", "") for p in parts)))
        elif kind == "message":
            out.append({"type": "message", "id": item.get("id") or new_id("msg"), "role": item["role"],
                        "status": "completed", "content": _parts(item.get("content"), "input_text")})
        elif kind == "function_call":
            out.append(call_item(item.get("id") or new_id("fc"), item["call_id"], item["name"], item["arguments"]))
        elif kind == "function_call_output":
            out.append({"type": "function_call_output", "id": item.get("id") or new_id("fco"),
                        "call_id": item["call_id"], "output": item.get("output"), "status": "completed"})
        else:  # reasoning items a client sent back: listed as sent
            out.append({**item, "id": item.get("id") or new_id("rs")})
    return out


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIMIT}, got {value!r}", "limit")
    return limit


def items_page(items: list[dict[str, Any]], limit: str | None, order: str | None, after: str | None,
               ) -> dict[str, Any]:
    """One page of ``items`` in OpenAI's list shape; ``order`` is ``desc`` (newest first, OpenAI's default) or
    ``asc``; ``after`` is the id of the item the page starts after."""
    if order not in (None, "asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", "order")
    n = _limit(limit)
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ProtocolError(404, f"No input item with id {after!r} in this response", "after", "not_found")
        start = ids.index(after) + 1
    page = ordered[start:start + n]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + n < len(ordered)}
