"""Backends that serve a model from one child process: start it, log it, stop it, notice its death."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

from runlm.runner.backends.base import Backend, BackendExitedError

STOP_GRACE_SECONDS = 10.0


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


class ProcessBackend(Backend):
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._processes: dict[str, asyncio.subprocess.Process] = {}

    def process_id(self, socket: str) -> int | None:
        proc = self._processes.get(socket)
        return proc.pid if proc else None

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env

    async def run_process(self, argv: list[str], socket: str, log_name: str) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{log_name}.log"
        with open(log_path, "ab") as log:
            log.write(f"--- {' '.join(argv)}\n".encode())
            log.flush()
            # a session of its own: a Ctrl-C at the daemon's terminal is the daemon's to handle
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.child_env(),
                start_new_session=True)
        self._processes[socket] = proc
        try:
            code = await proc.wait()
        except asyncio.CancelledError:
            await self._stop(proc)
            raise
        finally:
            self._processes.pop(socket, None)
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        raise BackendExitedError(f"the {self.name} backend process {how} (log: {log_path})", log_tail(log_path))

    @staticmethod
    async def _stop(proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), STOP_GRACE_SECONDS)
        except TimeoutError:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
