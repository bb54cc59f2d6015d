"""Chat templates from requests (issue 15 #3): refused unless the server trusts them; rendered off the
event loop either way, so a template that loops for ever leaves health checks and other requests answered."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import API_KEY
from tests.server.process import ServerProcess

HI = [{"role": "user", "content": "hi"}]
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_request_template_is_refused_by_default(smollm2_server) -> None:
    with httpx.Client(base_url=smollm2_server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        for path in ("/v1/chat/completions", "/tokenize"):
            r = http.post(path, json={"messages": HI, "max_tokens": 1,
                                      "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "chat_template_kwargs.chat_template"
            assert "--trust-request-chat-template" in err["message"]


@pytest.fixture(scope="module")
def trusting_server():
    server = ServerProcess("tinycoder", ["--kv-cache-memory", "64MiB", "--trust-request-chat-template"]).start()
    yield server
    server.stop()


def test_a_trusted_template_is_used(trusting_server) -> None:
    r = httpx.post(f"{trusting_server.url}/tokenize", timeout=30,
                   json={"messages": HI, "chat_template_kwargs": {"chat_template": "<<{{ messages[0].content }}>>"}})
    plain = httpx.post(f"{trusting_server.url}/tokenize", json={"prompt": "<<hi>>"}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"] == plain.json()["tokens"]


@pytest.mark.parametrize("template, within", [(SPIN, 9.0), ("{{ 'x' * 10**11 }}", 3.0)])
def test_hostile_templates_stop_and_the_loop_stays_free(trusting_server, template: str, within: float) -> None:
    url = trusting_server.url
    answers: list[httpx.Response] = []
    body = {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {"chat_template": template}}
    start = time.monotonic()
    worker = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)))
    worker.start()
    time.sleep(0.5)
    for _ in range(3):  # while it renders, the server answers at once
        t = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert time.monotonic() - t < 1.0
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=30)
        assert ok.status_code == 200
    worker.join(60)
    assert time.monotonic() - start < within + 3
    assert answers and answers[0].status_code == 400, answers
    assert "chat template" in answers[0].json()["error"]["message"]
