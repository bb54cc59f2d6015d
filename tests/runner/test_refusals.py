"""Refusals peers give (issue 31): an invalid name or a refused source is a 4xx before any stream starts, on the
Ollama, Model Runner and OpenAI routes, through the official clients where there is one."""
from __future__ import annotations

import ollama
import openai
import pytest

from tests.runner.daemon import Daemon

BAD = ["../../etc/passwd", "/etc", "a b c"]


@pytest.mark.parametrize("name", BAD)
def test_ollama_pull_streamed_refuses_before_streaming(daemon: Daemon, name: str) -> None:
    c = ollama.Client(host=daemon.url)
    with pytest.raises(ollama.ResponseError) as err:
        for _ in c.pull(name, stream=True):  # Ollama's default: stream true
            pass
    assert 400 <= err.value.status_code < 500, err.value
    r = daemon.http.post("/api/pull", json={"model": name})  # no "stream": true is the default
    assert 400 <= r.status_code < 500 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["error"]
    assert name not in {m.model for m in c.list().models}  # nothing was imported


@pytest.mark.parametrize("source", ["/some/dir", "../../etc/passwd", "file:///etc/passwd"])
def test_model_runner_create_refuses_before_streaming(daemon: Daemon, source: str) -> None:
    r = daemon.http.post("/models/create", json={"from": source})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["message"]


def test_model_runner_create_still_streams_a_good_pull(daemon: Daemon) -> None:
    r = daemon.http.post("/models/create", json={"from": "tinycoder"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    assert '"type": "success"' in r.text


@pytest.mark.parametrize("name", BAD)
def test_openai_routes_refuse_an_invalid_model_before_streaming(daemon: Daemon, name: str) -> None:
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as err:
        stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                stream=True, max_tokens=2)
        for _ in stream:
            pass
    assert 400 <= err.value.status_code < 500


def test_ollama_embed_truncates_by_default_and_refuses_when_told_not_to(daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url)
    c.pull("minilm")
    try:
        long = "word " * 600  # past minilm's 256 tokens
        assert len(c.embed(model="minilm", input=long).embeddings[0]) == 384  # Ollama's truncate: true
        with pytest.raises(ollama.ResponseError) as err:
            c.embed(model="minilm", input=long, truncate=False)
        assert err.value.status_code == 400
        openai_client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError):  # OpenAI's route refuses it unless truncation is asked
            openai_client.embeddings.create(model="minilm", input=long)
    finally:
        daemon.http.request("DELETE", "/api/delete", json={"model": "minilm", "force": True})
