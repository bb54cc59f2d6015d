"""A daemon that is SIGKILLed (or OOM-killed) leaves no backend behind (issue 15 #10)."""
from __future__ import annotations

import signal
from pathlib import Path

import psutil

from runlm.store import ModelStore
from tests.runner.daemon import Daemon


def test_backends_exit_when_the_daemon_is_killed(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "home")
    store.pull("tinycoder")
    d = Daemon(store.home).start()
    try:
        r = d.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})
        assert r.status_code == 200
        backend = psutil.Process(d.pid_of("tinycoder:latest"))
        assert "serve-engine" in " ".join(backend.cmdline())
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        gone, alive = psutil.wait_procs([backend], timeout=20)
        assert not alive, f"backend {backend.pid} outlived its SIGKILLed daemon"
    finally:
        d.proc.kill()
        d.http.close()
        d.log.close()
    again = Daemon(store.home, ("--force",)).start()  # a restarted daemon starts clean and serves
    try:
        assert again.ps() == []
        r = again.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})
        assert r.status_code == 200
    finally:
        again.stop()
