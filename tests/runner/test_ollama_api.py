"""The official ollama client against /api of a real daemon."""
from __future__ import annotations

import ollama
import pytest

from tests.runner.daemon import Daemon


def client(daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=daemon.url)


def test_version_tags_show(daemon: Daemon) -> None:
    c = client(daemon)
    assert daemon.http.get("/api/version").json()["version"]
    names = {m.model for m in c.list().models}
    assert "tinycoder:latest" in names
    shown = c.show("tinycoder")
    assert shown.details.format == "gguf" and shown.details.quantization_level == "F16"
    assert shown.modelinfo["llama.context_length"] == 2048
    assert "completion" in shown.capabilities
    with pytest.raises(ollama.ResponseError) as err:
        c.show("nope")
    assert err.value.status_code == 404 and "nope" in err.value.error


def test_show_gives_the_models_recommended_parameters(daemon: Daemon) -> None:
    c = client(daemon)
    c.pull("smollm2")
    try:
        shown = c.show("smollm2")
        assert shown.parameters.split() == ["temperature", "0.0", "top_p", "0.9"]  # DRY has no Ollama name
        assert "PARAMETER temperature" in shown.modelfile and "PARAMETER top_p" in shown.modelfile
        assert daemon.http.get("/models/smollm2").json()["config"]["sampling"] == {
            "temperature": 0.0, "top_p": 0.9, "dry_multiplier": 0.8}
        assert not c.show("tinycoder").parameters  # a model that recommends nothing
    finally:
        c.delete("smollm2")


def test_chat_and_generate_streaming_and_not(daemon: Daemon) -> None:
    c = client(daemon)
    r = c.chat(model="tinycoder", messages=[{"role": "user", "content": "hi"}],
               options={"num_predict": 6, "temperature": 0, "seed": 1})
    assert r.done and r.message.role == "assistant" and r.message.content
    assert r.eval_count == 6 and r.done_reason == "length" and r.prompt_eval_count > 0 and r.total_duration > 0
    parts = list(c.chat(model="tinycoder", messages=[{"role": "user", "content": "hi"}], stream=True,
                        options={"num_predict": 6, "temperature": 0, "seed": 1}))
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert "".join(p.message.content for p in parts) == r.message.content  # same seed, same answer
    gen = list(c.generate(model="tinycoder", prompt="def add(a, b):", stream=True, raw=True,
                          options={"num_predict": 4}))
    assert gen[-1].done and gen[-1].eval_count == 4 and "".join(g.response for g in gen)
    with pytest.raises(ollama.ResponseError, match="unknown option"):
        c.generate(model="tinycoder", prompt="x", options={"bogus_option": 1})


def test_pull_copy_delete_ps(daemon: Daemon) -> None:
    c = client(daemon)
    statuses = [p.status for p in c.pull("tinycoder", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    c.copy("tinycoder", "coder-copy:v1")
    assert "coder-copy:v1" in {m.model for m in c.list().models}
    c.generate(model="tinycoder", prompt="x", options={"num_predict": 1})
    loaded = {m.model: m for m in c.ps().models}
    assert loaded["tinycoder:latest"].size > 0 and loaded["tinycoder:latest"].expires_at is not None
    c.delete("coder-copy:v1")  # another name of a loaded model: the model stays
    assert "coder-copy:v1" not in {m.model for m in c.list().models}
    with pytest.raises(ollama.ResponseError) as err:
        c.delete("coder-copy:v1")
    assert err.value.status_code == 404


def test_keep_alive_zero_unloads_after_the_request(daemon: Daemon) -> None:
    c = client(daemon)
    c.generate(model="tinycoder", prompt="x", options={"num_predict": 1})
    assert any(r["model_name"] == "tinycoder:latest" for r in daemon.ps())
    pid = daemon.pid_of("tinycoder:latest")
    r = c.generate(model="tinycoder", prompt="x", options={"num_predict": 2}, keep_alive=0)
    assert r.done and r.response
    assert daemon.wait_unloaded("tinycoder:latest")
    assert pid not in daemon.backend_pids()  # the process is gone, not just forgotten


def test_load_and_unload_with_empty_requests(daemon: Daemon) -> None:
    c = client(daemon)
    loaded = c.generate(model="tinycoder", prompt="", keep_alive="-1")
    assert loaded.done_reason == "load"
    entry = next(r for r in daemon.ps() if r["model_name"] == "tinycoder:latest")
    assert entry["keep_alive"] == -1 and entry["expires_at"] is None  # -1: never unloaded
    unloaded = c.chat(model="tinycoder", messages=[], keep_alive=0)
    assert unloaded.done_reason == "unload" and daemon.wait_unloaded("tinycoder:latest", timeout=2)
    with pytest.raises(ollama.ResponseError, match="keep_alive"):
        c.generate(model="tinycoder", prompt="x", keep_alive="soon")


def test_embed_translates_to_the_backends_embeddings(daemon: Daemon) -> None:
    c = client(daemon)
    c.pull("minilm")
    try:
        out = c.embed(model="minilm", input=["The cat sat.", "A cat was sitting.", "Stock prices fell."])
    except ollama.ResponseError as exc:
        if "this is an embedding model; it cannot generate" in exc.error:  # serve-engine before pooling
            pytest.skip(f"this serve-engine cannot serve embeddings yet: {exc.error[:120]}")
        raise
    vecs = out.embeddings
    assert len(vecs) == 3 and len(vecs[0]) == 384

    def cos(a: list[float], b: list[float]) -> float:
        dot = sum(x * y for x, y in zip(a, b))
        return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)

    assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[2])  # a real sentence-embedding model
    legacy = daemon.http.post("/api/embeddings", json={"model": "minilm", "prompt": "The cat sat."}).json()
    assert len(legacy["embedding"]) == 384


@pytest.mark.parametrize("tool_calls", [
    "call it", [1], [{"function": "f"}], [{"function": {"arguments": {}}}], [{"function": {"name": ""}}],
    [{"function": {"name": "f", "arguments": "not an object"}}], [{"function": {"name": "f", "arguments": [1]}}],
])
def test_malformed_tool_calls_are_400(daemon: Daemon, tool_calls: object) -> None:
    """Issue 15 #11: these were 500s (KeyError, TypeError)."""
    body = {"model": "tinycoder", "stream": False, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": tool_calls}]}
    r = daemon.http.post("/api/chat", json=body)
    assert r.status_code == 400, r.text
    assert "tool_calls" in r.json()["error"]
