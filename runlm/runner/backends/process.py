"""Backends that serve a model from one child process: start it, log it, stop it, notice its death."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

from runlm.runner.backends.base import STATUS_INSTALLING, Backend, BackendError, BackendExitedError, format_status

STOP_GRACE_SECONDS = 10.0


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def package_size(name: str) -> int:
    """Bytes an installed Python package's folder takes (0 when it is not installed); found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return 0
    root = Path(next(iter(spec.submodule_search_locations)))
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# keys a child could inherit from the daemon's environment: a backend gets its own key, never these
INHERITED_KEYS = ("RUNLM_API_KEY", "LLAMA_API_KEY", "VLLM_API_KEY", "API_KEY", "OPENAI_API_KEY")


class ProcessBackend(Backend):
    # the environment variables through which this backend's server reads its API key
    api_key_env: tuple[str, ...] = ("RUNLM_API_KEY",)

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._processes: dict[str, asyncio.subprocess.Process] = {}
        self._keys: dict[str, str] = {}
        self._installing: str | None = None  # what pip is installing now
        self._install_error: str | None = None

    def install_status(self) -> str:
        """'Installing: ...' while pip_install runs, else 'Error: ...' (for when either is the backend's state)."""
        if self._installing:
            return format_status(STATUS_INSTALLING, f"pip install {self._installing}")
        return format_status("Error", self._install_error or "")

    async def pip_install(self, *packages: str) -> None:
        """Install ``packages`` into runlm's own environment (where the backend's process runs)."""
        self._installing, self._install_error = " ".join(packages), None
        log = self.log_dir / f"install-{self.name}.log"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(log, "wb") as out:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "pip", "install", *packages, stdout=out, stderr=out)
                code = await proc.wait()
        finally:
            self._installing = None
        if code != 0:
            self._install_error = f"pip install failed (log: {log})"
            raise BackendError(f"installing {' '.join(packages)} failed:\n{log_tail(log)}")

    def process_id(self, socket: str) -> int | None:
        proc = self._processes.get(socket)
        return proc.pid if proc else None

    def api_key_for(self, address: str) -> str:
        """A fresh secret per backend process: only the daemon can talk to it, whatever the socket's reach."""
        return self._keys.setdefault(address, secrets.token_urlsafe(32))

    def child_env(self, address: str, gpu: int | None = None) -> dict[str, str]:
        """The backend process's environment: the daemon's without its secrets, its own API key, and (``gpu``:
        the loader placed it on one of several) that GPU alone, counted in the driver's (PCI bus) order."""
        env = {k: v for k, v in os.environ.items() if k not in INHERITED_KEYS}
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.update(dict.fromkeys(self.api_key_env, self.api_key_for(address)))  # the environment, not argv:
        if gpu is not None:                                                       # argv is world-readable
            env.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(gpu))
        return env

    async def run_process(self, argv: list[str], socket: str, log_name: str, gpu: int | None = None) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{log_name}.log"
        with open(log_path, "ab") as log:
            log.write(f"--- {' '.join(argv)}\n".encode())
            log.flush()
            # a session of its own: a Ctrl-C at the daemon's terminal is the daemon's to handle
            # through parent_watch: the backend gets SIGTERM if the daemon dies without stopping it
            watched = [sys.executable, "-m", "runlm.runner.parent_watch", str(os.getpid()), *argv]
            proc = await asyncio.create_subprocess_exec(
                *watched, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.child_env(socket, gpu),
                start_new_session=True)
        self._processes[socket] = proc
        try:
            code = await proc.wait()
        except asyncio.CancelledError:
            await self._stop(proc)
            raise
        finally:
            self._processes.pop(socket, None)
            self._keys.pop(socket, None)
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
