"""Stored responses (``store``, the default): kept in memory for ``previous_response_id`` and
``GET/DELETE /v1/responses/{id}`` (and its ``input_items``), the oldest dropped past a bound, so a long-running
server stays small; a dropped or unknown id is a clear 404."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from runlm.apis.source import ProtocolError

DEFAULT_MAX_RESPONSES = 1000


@dataclass(slots=True, frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]   # chat messages through this response's output, without instructions
    input_items: list[dict[str, Any]] = field(default_factory=list)  # the request's input, as input_items lists it


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        self.max_responses = max_responses
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, item: StoredResponse) -> None:
        with self._lock:
            self._items[item.response["id"]] = item
            while len(self._items) > self.max_responses:
                self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        with self._lock:
            item = self._items.get(response_id)
        if item is None:
            raise ProtocolError(404, f"Response with id {response_id!r} not found (responses are kept in this "
                                     f"server's memory, the latest {self.max_responses}, and only with store "
                                     f"true)", param, "response_not_found")
        return item

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._items.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._items)
