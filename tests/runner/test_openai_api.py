"""The official openai client against /v1 and /engines/... of a real daemon with real backends."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.runner.daemon import Daemon


def client(daemon: Daemon, prefix: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + prefix, api_key="unused", max_retries=0)


@pytest.mark.parametrize("prefix", ["/v1", "/engines/v1", "/engines/native/v1"])
def test_chat_completion_on_every_prefix(daemon: Daemon, prefix: str) -> None:
    c = client(daemon, prefix)
    resp = c.chat.completions.create(model="tinycoder", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=4, temperature=0)
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content
    assert resp.usage.completion_tokens == 4
    assert "tinycoder:latest" in {m.id for m in c.models.list()}


def test_streaming_chat_and_completions(daemon: Daemon) -> None:
    c = client(daemon)
    chunks = list(c.chat.completions.create(model="tinycoder", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=5, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text and chunks[-1].usage.completion_tokens == 5
    comp = c.completions.create(model="tinycoder:latest", prompt="def add(a, b):", max_tokens=3, temperature=0)
    assert comp.choices[0].text and comp.choices[0].finish_reason == "length"


def test_errors_have_the_openai_shape(daemon: Daemon) -> None:
    c = client(daemon)
    with pytest.raises(openai.NotFoundError, match="pull it first"):
        c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    for body, param in (({"messages": []}, "model"), ({"model": "../../etc", "messages": []}, "model")):
        r = daemon.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = daemon.http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = daemon.http.post("/engines/nosuch/v1/chat/completions", json={"model": "tinycoder"})
    assert r.status_code == 404 and "nosuch" in r.json()["error"]["message"]
    r = daemon.http.post("/engines/vllm/v1/chat/completions", json={"model": "tinycoder", "messages": []})
    assert r.status_code == 503 and "Not Installed" in r.json()["error"]["message"]
    # the backend's own validation errors come through unchanged
    r = daemon.http.post("/v1/chat/completions", json={"model": "tinycoder", "temperature": -3,
                                                       "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


def test_concurrent_first_requests_share_one_load(daemon: Daemon) -> None:
    daemon.http.post("/engines/unload", json={"all": True})
    log = daemon.home / "logs" / "native-tinycoder_latest-completion.log"
    starts = log.read_text().count("--- ") if log.exists() else 0
    results: list[int] = []

    def ask() -> None:
        r = httpx.post(f"{daemon.url}/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 2},
                       timeout=300)
        results.append(r.status_code)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200, 200, 200]
    assert log.read_text().count("--- ") == starts + 1  # one backend process started for all three
    assert len([r for r in daemon.ps() if r["model_name"] == "tinycoder:latest"]) == 1


def _llamacpp_installed() -> bool:
    import importlib.util
    import shutil

    return bool(shutil.which("llama-server") or importlib.util.find_spec("llama_cpp"))


@pytest.mark.skipif(not _llamacpp_installed(),
                    reason="llama.cpp is not installed here (runlm install-backend llamacpp)")
def test_llamacpp_backend_through_the_gateway(daemon: Daemon) -> None:
    c = client(daemon, "/engines/llamacpp/v1")
    resp = c.completions.create(model="tinycoder", prompt="def add(a, b):", max_tokens=3, temperature=0)
    assert resp.choices[0].text
    runners = [r for r in daemon.ps() if r["backend_name"] == "llamacpp"]
    assert [r["model_name"] for r in runners] == ["tinycoder:latest"]  # a TCP backend, beside the native one
    assert daemon.http.post("/engines/unload", json={"models": ["tinycoder"], "backend": "llamacpp"}).json() == \
        {"unloaded_runners": 1}
