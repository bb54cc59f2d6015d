"""`runlm serve` as a real subprocess on a free loopback port, with its own RUNLM_HOME."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runlm_env(home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, RUNLM_HOME=str(home), TOKENIZERS_PARALLELISM="false", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("RUNLM_HOST", None)
    return env


def runlm(home: Path, *args: str, timeout: float = 300, input: str | None = None,
          **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runlm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, input=input, env=runlm_env(home, **env))


@dataclass
class Daemon:
    home: Path
    args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> Daemon:
        self.home.mkdir(parents=True, exist_ok=True)
        self.log = open(self.home / "daemon-test.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "runlm.cli", "serve", "--port", str(self.port),
                                      *self.args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=runlm_env(self.home, **self.env))
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=300)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.home / "daemon-test.log").read_text()
            try:
                if self.http.get("/").status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError("runlm serve did not start")

    def ps(self) -> list[dict]:
        return self.http.get("/engines/ps").json()

    def pid_of(self, model: str) -> int:
        return next(r["pid"] for r in self.ps() if r["model_name"] == model)

    def backend_pids(self) -> set[int]:
        return {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}

    def wait_unloaded(self, model: str, timeout: float = 15) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(r["model_name"] != model for r in self.ps()):
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        children = [psutil.Process(p) for p in self.backend_pids()]
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=40)
        finally:
            self.proc.kill()
            self.http.close()
            self.log.close()
        gone, alive = psutil.wait_procs(children, timeout=15)
        for p in alive:
            p.kill()
        assert not alive, f"backend processes outlived the daemon: {[p.pid for p in alive]}"
