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


# issue 33: each of these took the server's RSS to 2-5 GB and held the GIL for seconds in one C call
REPLACE_BOMB = "{% set s = 'x' * 1000000 %}{{ s.replace('x', 'y' * 4000)|length }}"
JOIN_BOMB = "{% set l = ['y' * 20000000] * 200 %}{{ l|join('')|length }}"
TILDE_BOMB = ("{% set ns = namespace(s='x' * 30000000) %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
              "{% endfor %}{{ ns.s|length }}")


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


@pytest.mark.parametrize("template, within", [(SPIN, 9.0), ("{{ 'x' * 10**11 }}", 3.0), (REPLACE_BOMB, 3.0),
                                              (JOIN_BOMB, 3.0), (TILDE_BOMB, 3.0)])
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
    err = answers[0].json()["error"]
    assert "the request's chat template" in err["message"] and err["param"] == "chat_template_kwargs.chat_template"
    assert _peak_rss_mib(trusting_server.proc.pid) < 1024  # the template's memory was never the server's


def test_a_bomb_in_the_models_own_template_is_a_500_naming_it(tmp_path) -> None:
    import shutil

    from tests.fixtures.models import build_model

    model = tmp_path / "model"
    shutil.copytree(build_model("llama"), model)
    (model / "chat_template.jinja").write_text(REPLACE_BOMB)
    server = ServerProcess(str(model), ["--kv-cache-memory", "64MiB"]).start()
    try:
        start = time.monotonic()
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HI, "max_tokens": 1}, timeout=60)
        assert time.monotonic() - start < 5
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "chat_template_limit"
        assert "the model's chat template" in err["message"] and "memory limit" in err["message"]
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=30)
        assert ok.status_code == 200  # and the server goes on
        assert _peak_rss_mib(server.proc.pid) < 1024
    finally:
        server.stop()
