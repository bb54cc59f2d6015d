"""Loading, unloading and failure with real backend processes: several models, eviction, death, pulls."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from runlm.runner.backends.native import NativeBackend
from runlm.runner.config import BackendConfig
from runlm.store import ModelStore
from tests.runner.daemon import Daemon, runlm_env
from tests.store.file_server import FileServer, Served


def ask(daemon: Daemon, model: str, max_tokens: int = 2) -> str:
    c = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)
    return c.completions.create(model=model, prompt="a", max_tokens=max_tokens).choices[0].text


def test_two_models_loaded_at_once(daemon: Daemon, qwen2_dir: Path) -> None:
    ModelStore(daemon.home).pull(str(qwen2_dir), name="tiny-qwen2")
    ask(daemon, "tinycoder")
    ask(daemon, "tiny-qwen2")
    loaded = {r["model_name"]: r for r in daemon.ps()}
    assert {"tinycoder:latest", "tiny-qwen2:latest"} <= set(loaded)
    assert loaded["tinycoder:latest"]["pid"] != loaded["tiny-qwen2:latest"]["pid"]
    assert {loaded["tinycoder:latest"]["pid"], loaded["tiny-qwen2:latest"]["pid"]} <= daemon.backend_pids()
    ask(daemon, "tinycoder")  # both still answer, neither was reloaded
    assert {r["model_name"]: r["pid"] for r in daemon.ps()}["tinycoder:latest"] == loaded["tinycoder:latest"]["pid"]


def test_backend_killed_mid_stream_errors_then_reloads(daemon: Daemon) -> None:
    ask(daemon, "tinycoder")
    pid = daemon.pid_of("tinycoder:latest")
    c = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)
    stream = c.chat.completions.create(model="tinycoder", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
    received = 0
    with pytest.raises(openai.APIError, match="stopped while answering"):
        for _ in stream:
            received += 1
            if received == 2:
                os.kill(pid, signal.SIGKILL)
    assert received >= 2
    assert all(r["model_name"] != "tinycoder:latest" for r in daemon.ps())  # unloaded at once
    assert ask(daemon, "tinycoder")  # the next request loads it again
    assert daemon.pid_of("tinycoder:latest") != pid


def _need(store: ModelStore, name: str) -> int:
    return NativeBackend(store.logs).required_memory(store.get(name), BackendConfig()).ram


def test_memory_budget_evicts_least_recently_used(tmp_path: Path, qwen2_dir: Path) -> None:
    store = ModelStore(tmp_path / "home")
    store.pull("tinycoder")
    store.pull(str(qwen2_dir), name="tiny-qwen2")
    budget = _need(store, "tinycoder") + _need(store, "tiny-qwen2") - 1  # either fits, not both
    d = Daemon(store.home, ("--memory-budget", str(budget))).start()
    try:
        ask(d, "tinycoder")
        first = d.pid_of("tinycoder:latest")
        ask(d, "tiny-qwen2")
        assert [r["model_name"] for r in d.ps()] == ["tiny-qwen2:latest"]
        assert first not in d.backend_pids()  # evicted means its process is gone
        ask(d, "tinycoder")
        assert [r["model_name"] for r in d.ps()] == ["tinycoder:latest"]
    finally:
        d.stop()  # (every Daemon.stop asserts that no backend process outlives the daemon)
    assert not (store.home / "daemon.json").exists()


def test_model_that_can_never_fit_is_refused_up_front(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "home")
    store.pull("tinycoder")
    d = Daemon(store.home, ("--memory-budget", "100MiB")).start()
    try:
        r = d.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})
        assert r.status_code == 507
        err = r.json()["error"]
        assert err["code"] == "model_too_large" and "memory budget is 100.0 MiB" in err["message"]
        assert d.ps() == [] and d.backend_pids() == set()  # nothing was started
    finally:
        d.stop()


def test_two_concurrent_pulls_store_the_model_once(tmp_path: Path, tinycoder_gguf: Path) -> None:
    server = FileServer()
    url = server.start()
    server.files["/tiny.gguf"] = Served(tinycoder_gguf, delay=0.1)  # ~1 s transfer: the pulls overlap
    home = tmp_path / "home"
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "runlm.cli", "pull", f"{url}/tiny.gguf"],
                                  env=runlm_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        server.stop()
    assert [p.returncode for p in procs] == [0, 0], outs
    store = ModelStore(home)
    assert [str(m.name) for m in store.list()] == ["tiny:latest"]
    assert len(store.blobs.digests()) == 1
    assert sum(sent for _, _, sent in server.log) == tinycoder_gguf.stat().st_size  # downloaded once
    assert "success" in outs[0][1] and "success" in outs[1][1]
