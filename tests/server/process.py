"""A real ``runlm serve-engine`` child process for tests: started, waited for, stopped."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1")


@dataclass
class ServerProcess:
    model: str
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    url: str = ""
    log: list[str] = field(default_factory=list)
    verify: str | bool = True  # an HTTPS server's certificate
    env: dict[str, str] = field(default_factory=dict)  # beside ENV

    def start(self, timeout: float = 240) -> ServerProcess:
        cmd = [sys.executable, "-m", "runlm.cli", "serve-engine", self.model, "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**ENV, **self.env})
        found = threading.Event()

        def read() -> None:  # keep draining stderr so the child never blocks on a full pipe
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r" on (https?://\S+)", line)
                if m and not self.url:
                    self.url = m.group(1)
                    found.set()
        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        if not found.wait(timeout):
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(self.log))
            try:
                if httpx.get(f"{self.url}/health", timeout=5, verify=self.verify).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError("server never became healthy:\n" + "".join(self.log))

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
