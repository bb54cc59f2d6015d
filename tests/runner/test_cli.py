"""The runlm commands against a running daemon, and without one."""
from __future__ import annotations

import json
from pathlib import Path

from runlm.store import ModelStore
from tests.runner.daemon import Daemon, runlm


def test_run_goes_through_the_daemon(daemon: Daemon) -> None:
    daemon.http.post("/engines/unload", json={"all": True})
    res = runlm(daemon.home, "run", "tinycoder", "hello", "--max-tokens", "4", "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert any(r["model_name"] == "tinycoder:latest" for r in daemon.ps())  # the daemon loaded it


def test_ls_show_ps_status_stop(daemon: Daemon) -> None:
    home = daemon.home
    ls = runlm(home, "ls")
    assert ls.returncode == 0 and ls.stdout.startswith("NAME") and "tinycoder:latest" in ls.stdout
    models = json.loads(runlm(home, "ls", "--json").stdout)
    assert any("tinycoder:latest" in m["tags"] for m in models)
    show = runlm(home, "show", "tinycoder")
    assert "quantization    F16" in show.stdout and "context length  2048" in show.stdout
    daemon.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})
    ps = runlm(home, "ps")
    assert ps.stdout.startswith("NAME") and "tinycoder:latest" in ps.stdout and "native" in ps.stdout
    loaded = next(r for r in daemon.ps() if r["model_name"] == "tinycoder:latest")
    assert 50 << 20 < loaded["resident"] < loaded["memory"]["ram"]  # measured, and within what was reserved
    rm = runlm(home, "rm", "tinycoder")
    assert rm.returncode == 1 and "is loaded" in rm.stderr
    status = json.loads(runlm(home, "status", "--json").stdout)
    assert status["daemon"] == daemon.url and status["backends"]["native"].startswith("Running")
    stop = runlm(home, "stop", "tinycoder")
    assert stop.returncode == 0 and "unloaded 1" in stop.stdout
    assert all(r["model_name"] != "tinycoder:latest" for r in daemon.ps())
    cfg = runlm(home, "configure", "tinycoder", "--runtime-flags", "--evil-flag 1")
    assert cfg.returncode == 1 and "not allowed" in cfg.stderr


def test_store_commands_without_a_daemon(tmp_path: Path) -> None:
    home = tmp_path / "home"
    pull = runlm(home, "pull", "tinycoder")
    assert pull.returncode == 0 and "success" in pull.stderr and "2.8 MB/2.8 MB" in pull.stderr
    assert runlm(home, "tag", "tinycoder", "mine:v1").returncode == 0
    assert {str(m.name) for m in ModelStore(home).list()} == {"tinycoder:latest", "mine:v1"}
    df = json.loads(runlm(home, "df", "--json").stdout)
    assert df["models_disk_usage"] == ModelStore(home).disk_usage()["models"]
    assert runlm(home, "rm", "mine:v1", "tinycoder").returncode == 0
    assert ModelStore(home).list() == []
    bad = runlm(home, "show", "../../etc/passwd")
    assert bad.returncode == 1 and "invalid model name" in bad.stderr and "Traceback" not in bad.stderr
    ps = runlm(home, "ps")
    assert ps.returncode == 1 and "runlm serve" in ps.stderr
    # `run` without a daemon loads the stored model in-process
    runlm(home, "pull", "tinycoder", "--name", "coder")
    res = runlm(home, "run", "coder", "hi", "--max-tokens", "3")
    assert res.returncode == 0 and res.stdout.strip()
