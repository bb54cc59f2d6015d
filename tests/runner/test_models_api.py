"""Docker Model Runner's routes: /models, /engines/{status,ps,df,unload,_configure}, /metrics."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from runlm.store import ModelStore
from tests.runner.daemon import Daemon


def test_create_list_inspect_tag(daemon: Daemon) -> None:
    with daemon.http.stream("POST", "/models/create", json={"from": "tinycoder", "name": "dmr/coder"}) as r:
        msgs = [json.loads(line) for line in r.iter_lines() if line]
    assert msgs[-1]["type"] == "success" and any(m["type"] == "progress" for m in msgs)
    models = daemon.http.get("/models").json()
    coder = next(m for m in models if "dmr/coder:latest" in m["tags"])
    assert "tinycoder:latest" in coder["tags"]  # one model id, both names
    assert coder["config"]["format"] == "gguf" and coder["config"]["size"] > 2_000_000
    one = daemon.http.get("/models/dmr/coder").json()
    assert one["id"] == coder["id"] and one["config"]["context_size"] == 2048
    r = daemon.http.post("/models/dmr/coder/tag", params={"repo": "dmr/coder", "tag": "v2"})
    assert r.status_code == 201
    assert daemon.http.get("/models/dmr/coder:v2").json()["id"] == coder["id"]
    bad = daemon.http.post("/models/create", json={"from": "/no/such/file.gguf"})
    assert bad.status_code == 400 and bad.json()["error"]["message"]  # refused before any stream (issue 31)
    assert daemon.http.get("/models/..%2F..%2Fetc").status_code in (400, 404)


def test_delete_refused_while_loaded_unless_forced(daemon: Daemon, qwen2_dir: Path) -> None:
    ModelStore(daemon.home).pull(str(qwen2_dir), name="solo")  # local files: the CLI's way, not HTTP
    for tag in daemon.http.get("/models/solo").json()["tags"]:
        if tag != "solo:latest":  # other tests may have stored the same files under other names
            daemon.http.delete(f"/models/{tag}", params={"force": "true"})
    r = daemon.http.post("/v1/completions", json={"model": "solo", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 200
    r = daemon.http.delete("/models/solo")
    assert r.status_code == 409 and "loaded" in r.json()["error"]["message"]
    r = daemon.http.delete("/models/solo", params={"force": "true"})
    assert r.status_code == 200
    assert all(x["model_name"] != "solo:latest" for x in daemon.ps())
    assert daemon.http.get("/models/solo").status_code == 404


def test_status_df_unload(daemon: Daemon) -> None:
    status = daemon.http.get("/engines/status").json()
    assert status["native"].startswith("Running: ")
    assert status["vllm"].startswith("Not Installed")
    assert status["llamacpp"].split(":")[0] in ("Running", "Not Installed")
    df = daemon.http.get("/engines/df").json()
    assert df["models_disk_usage"] > 2_000_000
    daemon.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})
    assert daemon.http.post("/engines/unload", json={"models": ["tinycoder"]}).json()["unloaded_runners"] == 1
    assert daemon.ps() == [] or all(r["model_name"] != "tinycoder:latest" for r in daemon.ps())
    assert daemon.http.post("/engines/unload", json={}).status_code == 400


def test_configure_validates_and_is_refused_while_busy(daemon: Daemon) -> None:
    r = daemon.http.post("/engines/_configure", json={"model": "tinycoder", "runtime-flags": ["--rm-rf", "/"]})
    assert r.status_code == 400 and "not allowed" in r.json()["error"]["message"]
    r = daemon.http.post("/engines/_configure", json={"model": "tinycoder", "context-size": 512,
                                                      "runtime-flags": ["--max-num-seqs", "4"], "keep_alive": "10m"})
    assert r.status_code == 202
    daemon.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})
    entry = next(x for x in daemon.ps() if x["model_name"] == "tinycoder:latest")
    assert entry["context_size"] == 512 and entry["keep_alive"] == 600
    # while a request streams, the model's configuration cannot change
    started, finished = threading.Event(), threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{daemon.url}/v1/completions", timeout=300,
                          json={"model": "tinycoder", "prompt": "a", "max_tokens": 500, "stream": True,
                                "ignore_eos": True}) as resp:
            for _ in resp.iter_lines():
                started.set()
                if finished.is_set():
                    break  # hang up: the gateway aborts the request and releases the model

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    r = daemon.http.post("/engines/_configure", json={"model": "tinycoder", "context-size": 1024})
    finished.set()
    t.join()
    assert r.status_code == 409 and r.json()["error"]["code"] == "runner_active"
    # settings belong to one backend: llama.cpp does not get the native flags
    r = daemon.http.post("/engines/llamacpp/_configure",
                         json={"model": "tinycoder", "runtime-flags": ["--max-num-seqs", "4"]})
    assert r.status_code == 400 and "llamacpp" in r.json()["error"]["message"]
    deadline = time.monotonic() + 60
    while daemon.http.post("/engines/_configure", json={"model": "tinycoder"}).status_code != 202:  # back to defaults
        assert time.monotonic() < deadline, "the hung-up stream never released the model"
        time.sleep(0.2)


def test_metrics_are_labelled_by_model(daemon: Daemon) -> None:
    daemon.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})
    text = daemon.http.get("/metrics").text
    assert "runlm_runner_loaded_models" in text
    labelled = [line for line in text.splitlines() if 'model="tinycoder:latest"' in line]
    assert labelled and all('backend="native"' in line for line in labelled)


def test_name_collisions_are_409_without_the_store_path(daemon: Daemon) -> None:
    """Issue 15 #11: 'a:b' and 'a/b:c' cannot both exist; that was a 500 naming the store's files."""
    assert daemon.http.post("/models/tinycoder/tag", json={"target": "clash:x"}).status_code == 201
    for r in (daemon.http.post("/models/tinycoder/tag", json={"target": "clash/x:y"}),
              daemon.http.post("/api/copy", json={"source": "tinycoder", "destination": "clash/x:y"})):
        assert r.status_code == 409, r.text
        assert str(daemon.home) not in r.text and "conflicts" in r.text
    r = daemon.http.post("/models/create", json={"from": "tinycoder", "name": "clash/x:z"})
    last = json.loads(r.text.splitlines()[-1])
    assert last["type"] == "error" and "conflicts" in last["message"] and str(daemon.home) not in last["message"]
    assert daemon.http.get("/models/clash/x").status_code == 404
