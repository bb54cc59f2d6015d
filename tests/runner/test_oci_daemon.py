"""Registry pulls and pushes through the daemon: Ollama's /api/pull and /api/push (with the official ollama
client), Model Runner's /models/create and /models/{name}/push, against a real registry."""
from __future__ import annotations

import json
import stat
from pathlib import Path

import ollama
import pytest

from runlm.store import ModelStore
from runlm.store.oci import credentials
from tests.fixtures.registry import PASSWORD, USER, Registry
from tests.runner.daemon import Daemon, runlm


def _lines(r) -> list[dict]:  # type: ignore[no-untyped-def]
    return [json.loads(line) for line in r.text.splitlines()]


def test_ollama_push_and_pull_through_the_daemon(daemon: Daemon, registry: Registry) -> None:
    credentials.save(registry.host, credentials.Credentials(USER, PASSWORD), daemon.home)
    c = ollama.Client(host=daemon.url)
    ref = f"{registry.host}/team/tinycoder:v1"
    c.copy("tinycoder", "team/tinycoder:v1")  # Ollama's way: name it for the registry, then push
    statuses = [p.status for p in c.push(ref, insecure=True, stream=True)]
    assert statuses[-1] == "success" and any(s.startswith("pushing ") for s in statuses)
    c.delete("team/tinycoder:v1")
    statuses = [p.status for p in c.pull(ref, insecure=True, stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    models = daemon.http.get("/models").json()
    tagged = next(m for m in models if "team/tinycoder:v1" in m["tags"])
    assert tagged["registry"]["team/tinycoder:v1"]["reference"] == ref
    assert tagged["id"] == next(m["id"] for m in models if "tinycoder:latest" in m["tags"])  # the same files
    with pytest.raises(ollama.ResponseError) as err:
        c.pull(f"{registry.host}/team/never-pushed:v1", insecure=True)
    assert "no such model" in str(err.value)


def test_model_runner_create_and_push(daemon: Daemon, registry: Registry) -> None:
    credentials.save(registry.host, credentials.Credentials(USER, PASSWORD), daemon.home)
    target = f"{registry.host}/dmr/tinycoder:q"
    r = daemon.http.post("/models/tinycoder/push", json={"target": target, "insecure": True})
    last = _lines(r)[-1]
    assert last["type"] == "success" and last["digest"].startswith("sha256:")
    r = daemon.http.post("/models/create", json={"from": target, "name": "dmr-copy", "insecure": True})
    assert _lines(r)[-1]["type"] == "success"
    stored = ModelStore(daemon.home).get("dmr-copy")
    assert stored.manifest["oci"]["manifest"] == last["digest"]
    # without insecure the daemon never falls back to plain http
    r = daemon.http.post("/models/create", json={"from": target, "name": "dmr-copy2"})
    assert _lines(r)[-1]["type"] == "error" and "https" in _lines(r)[-1]["message"]


def test_cli_login_package_push_ls(registry: Registry, tinycoder_gguf: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    login = runlm(home, "login", registry.host, "-u", USER, "--password-stdin", "--insecure",
                  input=PASSWORD + "\n")
    assert login.returncode == 0, login.stderr
    assert stat.S_IMODE(credentials.auth_file(home).stat().st_mode) == 0o600
    bad = runlm(home, "login", registry.host, "-u", USER, "--password-stdin", "--insecure", input="nope\n")
    assert bad.returncode == 1 and "refused the credentials" in bad.stderr
    ref = f"{registry.host}/cli/tiny:v1"
    done = runlm(home, "package", str(tinycoder_gguf), ref, "--context-size", "256", "--push", "--insecure")
    assert done.returncode == 0, done.stderr
    assert "pushing " in done.stderr and "ETA" in done.stderr  # progress bars: bytes, rate, ETA per layer
    ls = runlm(home, "ls")
    assert "REGISTRY REFERENCE" in ls.stdout and ref in ls.stdout
    remote = runlm(home, "inspect", ref, "--remote", "--insecure")
    assert json.loads(remote.stdout)["config"]["config"]["context_size"] == 256
