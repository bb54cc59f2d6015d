"""``python -m runlm.runner.parent_watch PID ARGV...``: exec ARGV so that it is sent SIGTERM when process PID
(the daemon) dies, however it dies (SIGKILL, the OOM killer). A backend never outlives its daemon.

Linux's parent-death signal (prctl PR_SET_PDEATHSIG) is kept across exec, so it covers any backend
binary (runlm serve-engine, llama-server, vLLM). It is set here, in the child, after fork: Python's
preexec_fn is unsafe in a threaded daemon. If PID is already gone when the signal is armed, ARGV is
not run at all.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def arm(parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the daemon died before the signal was armed
        raise SystemExit(0)


def main(argv: list[str]) -> None:
    parent, command = int(argv[0]), argv[1:]
    arm(parent)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
