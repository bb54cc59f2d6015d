"""A backend that hangs (here: SIGSTOP) is found by the daemon's health checks and replaced (issue 15, faults)."""
from __future__ import annotations

import os
import signal
import time

import psutil

from runlm.runner.health import HEALTH_FAILURES, HEALTH_INTERVAL, HEALTH_TIMEOUT
from tests.runner.daemon import Daemon


def test_a_stopped_backend_is_replaced(daemon: Daemon) -> None:
    r = daemon.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 200
    pid = daemon.pid_of("tinycoder:latest")
    os.kill(pid, signal.SIGSTOP)
    try:
        limit = HEALTH_FAILURES * (HEALTH_INTERVAL + HEALTH_TIMEOUT) + 20  # detection, then SIGTERM's grace
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and psutil.pid_exists(pid) and \
                psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.5)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, \
            f"the hung backend {pid} is still there after {limit:.0f}s"
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGCONT)
    r = daemon.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 200  # loaded again, in a new process
    assert daemon.pid_of("tinycoder:latest") != pid
