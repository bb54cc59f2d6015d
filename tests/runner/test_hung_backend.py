"""A backend that hangs (here: SIGSTOP) is found by the daemon's health checks and replaced (issue 15, faults)."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import psutil
import pytest

from runlm.runner.health import HEALTH_FAILURES
from runlm.store import ModelStore
from tests.runner.daemon import Daemon

HEALTH_INTERVAL = HEALTH_TIMEOUT = 1.0  # (this daemon's watch: $RUNLM_HEALTH_INTERVAL / $RUNLM_HEALTH_TIMEOUT)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    home = tmp_path_factory.mktemp("runlm-home")
    ModelStore(home).pull("tinycoder")
    d = Daemon(home, env={"RUNLM_HEALTH_INTERVAL": str(HEALTH_INTERVAL),
                          "RUNLM_HEALTH_TIMEOUT": str(HEALTH_TIMEOUT)}).start()
    yield d
    d.stop()


def test_a_stopped_backend_is_replaced(daemon: Daemon) -> None:
    r = daemon.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 200
    pid = daemon.pid_of("tinycoder:latest")
    os.kill(pid, signal.SIGSTOP)
    try:
        limit = HEALTH_FAILURES * (HEALTH_INTERVAL + HEALTH_TIMEOUT) + 20  # detection, then SIGTERM's grace
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.5)
        assert not _alive(pid), f"the hung backend {pid} is still there after {limit:.0f}s"
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGCONT)
    r = daemon.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 200  # loaded again, in a new process
    assert daemon.pid_of("tinycoder:latest") != pid


def _alive(pid: int) -> bool:
    """Whether the process is there and not a zombie (it may go between the two questions)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
