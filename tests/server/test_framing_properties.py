"""Property tests of the stream framings (issue 15, "make the classes impossible"): whatever text a model
produces, one SSE event (serve-engine) or one NDJSON line (the daemon's Ollama routes) reads back as exactly
that payload with the line readers our own clients use (httpx's iter_lines, as the daemon's proxy does)."""
from __future__ import annotations

import json

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from runlm.runner.ollama_stream import ndjson_line
from runlm.server.sse import DONE, event

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
payloads = st.dictionaries(st.text(max_size=8), json_values, max_size=5)
# the characters str.splitlines (and so httpx's line reader) breaks lines at, besides \n and \r
LINE_BREAKERS = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def _read_lines(body: bytes) -> list[str]:
    return list(httpx.Response(200, content=body).iter_lines())


@settings(max_examples=300, deadline=None)
@given(st.lists(payloads, min_size=1, max_size=4), st.text(alphabet=LINE_BREAKERS + "\n\rab", max_size=10))
def test_sse_events_read_back_whole(events: list[dict], text: str) -> None:
    events = [*events, {"choices": [{"delta": {"content": text}}]}]
    body = ("".join(event(e) for e in events) + DONE).encode()
    got = [json.loads(line[5:]) for line in _read_lines(body) if line.startswith("data:") and line != DONE.strip()]
    assert got == events


@settings(max_examples=300, deadline=None)
@given(st.lists(payloads, min_size=1, max_size=4), st.text(alphabet=LINE_BREAKERS + "\n\rab", max_size=10))
def test_ndjson_lines_read_back_whole(objs: list[dict], text: str) -> None:
    objs = [*objs, {"response": text}]
    body = b"".join(ndjson_line(o) for o in objs)
    assert [json.loads(line) for line in _read_lines(body) if line] == objs
