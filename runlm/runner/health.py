"""Backends that stop answering are replaced: a loaded backend whose health check fails (no answer within
HEALTH_TIMEOUT, or an error) HEALTH_FAILURES times in a row is stopped, so the next request loads it again.
A process that hangs (a deadlock, SIGSTOP, swapping to death) is as dead to clients as one that crashed."""
from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Protocol

import httpx

if TYPE_CHECKING:
    from runlm.runner.runner import Runner


class Loader(Protocol):
    """What the health watch needs of the loader (runlm/runner/loader.py): the backends, and a way to stop one."""

    runners: dict

    async def unload(self, runner: Runner) -> None: ...

log = logging.getLogger("runlm.runner")

# seconds between checks and for an answer ($RUNLM_HEALTH_INTERVAL / $RUNLM_HEALTH_TIMEOUT: an operator's choice,
# and the tests' shorter watch), and failures in a row before a backend is replaced
HEALTH_INTERVAL = float(os.environ.get("RUNLM_HEALTH_INTERVAL", "5"))
HEALTH_TIMEOUT = float(os.environ.get("RUNLM_HEALTH_TIMEOUT", "5"))
HEALTH_FAILURES = 2


async def _healthy(runner: Runner) -> bool:
    try:
        resp = await runner.client.get(runner.backend.health_path, timeout=HEALTH_TIMEOUT)
    except (httpx.HTTPError, RuntimeError):  # RuntimeError: the client closed as the process died
        return False
    return resp.status_code == 200


async def _check(loader: Loader, runner: Runner, failures: dict[int, int]) -> None:
    if await _healthy(runner):
        failures.pop(id(runner), None)
        return
    failures[id(runner)] = failures.get(id(runner), 0) + 1
    if failures[id(runner)] >= HEALTH_FAILURES and runner.ready and not runner.stopping and not runner.dead:
        log.warning("the %s backend serving %s (pid %s) failed %d health checks in a row; replacing it",
                    runner.backend.name, runner.model_ref, runner.pid, HEALTH_FAILURES)
        runner.error = f"it stopped answering health checks ({HEALTH_FAILURES} x {HEALTH_TIMEOUT:.0f}s)"
        failures.pop(id(runner), None)
        await loader.unload(runner)


async def watch_health(loader: Loader) -> None:
    """Runs for the daemon's life: every HEALTH_INTERVAL, every ready backend is asked, all at once."""
    failures: dict[int, int] = {}
    while True:
        await asyncio.sleep(HEALTH_INTERVAL)
        ready = [r for r in list(loader.runners.values()) if r.ready and not r.stopping and not r.dead]
        await asyncio.gather(*(_check(loader, r, failures) for r in ready), return_exceptions=True)
