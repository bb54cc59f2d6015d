"""A client that stops waiting for a non-streamed answer through the daemon stops the backend's work too
(issue 15 #7), on the OpenAI and the Ollama routes, and the model is evictable again."""
from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from tests.runner.daemon import Daemon

LONG = {"max_tokens": 1900, "ignore_eos": True, "temperature": 1.0}


def _running(daemon: Daemon) -> float:
    text = daemon.http.get("/metrics").text
    return sum(float(v) for v in re.findall(r'^runlm:num_requests_running\{[^}]*model="tinycoder[^}]*\}\s+(\S+)',
                                            text, re.M))


def _give_up_after(url: str, path: str, body: dict, seconds: float) -> None:
    try:
        httpx.post(url + path, json=body, timeout=seconds)
    except httpx.TimeoutException:
        pass


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tinycoder", "prompt": "once upon a time", **LONG}),
    ("/v1/chat/completions", {"model": "tinycoder", "messages": [{"role": "user", "content": "hi"}], **LONG}),
    ("/api/generate", {"model": "tinycoder", "prompt": "once", "stream": False,
                       "options": {"num_predict": 1900, "temperature": 1.0}}),
])
def test_clients_that_give_up_abort_the_backend_work(daemon: Daemon, path: str, body: dict) -> None:
    daemon.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})  # loaded
    clients = [threading.Thread(target=_give_up_after, args=(daemon.url, path, body, 1.0)) for _ in range(8)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (_running(daemon) or any(r["in_use"] for r in daemon.ps())):
        time.sleep(0.1)
    assert _running(daemon) == 0, "the backend kept generating for clients that left"
    assert not any(r["in_use"] for r in daemon.ps())
    r = daemon.http.post("/engines/unload", json={"models": ["tinycoder"]})
    assert r.status_code == 200 and r.json()["unloaded_runners"] == 1  # evictable at once
