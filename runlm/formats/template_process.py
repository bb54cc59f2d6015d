"""Chat templates rendered in worker processes with a memory and a CPU limit (issue 33).

The sandbox (runlm/formats/template_limits.py) bounds what it can see before it happens, but one C call
(``str.replace`` of a million characters by four thousand, ``join``, ``tojson(indent=...)``) can allocate
gigabytes and hold the GIL for seconds, and no thread can interrupt it. So the render itself happens in a
small process of its own: its address space is capped (RLIMIT_AS), so such a call fails with MemoryError
there; its CPU time is capped (RLIMIT_CPU) and its wall time watched from here, and a worker past its time
is killed. The caller's process never holds the template's memory, and its other requests go on.

The protocol is one pickle down (the worker trusts its parent) and a status byte, a length and UTF-8 text
up (the parent trusts nothing from the worker: the length is checked before anything is read).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from runlm.formats.template_limits import MAX_CHARS, RENDER_SECONDS, RenderLimitError
from runlm.formats.template_render import ChatTemplateError, ChatTemplateLimitError, render_in_process

MEMORY_BYTES = 512 << 20    # address space a worker may add on top of what it has once started
WORKERS = 4                 # renders at once; more wait for a worker (up to their deadline)
KILL_AFTER = RENDER_SECONDS + 0.5  # the worker checks its own deadline; past this it is killed
START_SECONDS = 30.0
MAX_REPLY = 4 * MAX_CHARS + 4096   # UTF-8 of the longest output the sandbox lets through
_OK, _TEMPLATE_ERROR, _LIMIT, _TYPE_ERROR = 0, 1, 2, 3
_REPLY = struct.Struct("<BQ")


class _Worker:
    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # the folder that holds the runlm package
        boot = f"import sys; sys.path.insert(0, {root!r}); from runlm.formats.template_process import serve; serve()"
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", boot], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        if self._read(1, time.monotonic() + START_SECONDS) != b"R":
            self.kill()
            raise RenderLimitError("the chat template worker process did not start")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):  # unflushed bytes to a dead process: a broken pipe
                pipe.close()

    def _read(self, n: int, deadline: float) -> bytes:
        """n bytes from the worker by ``deadline``; b'' when it died, RenderLimitError when it ran out of time."""
        fd, out = self.stdout.fileno(), bytearray()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RenderLimitError("the chat template took too long to render (its process was stopped)")
            # short waits: a thread interrupted from outside (runlm/server/render.py) gets its exception soon
            ready, _, _ = select.select([fd], [], [], min(left, 0.25))
            if ready:
                chunk = os.read(fd, min(n - len(out), 1 << 20))
                if not chunk:
                    return b""
                out += chunk
        return bytes(out)

    def render(self, payload: bytes) -> tuple[int, str]:
        deadline = time.monotonic() + KILL_AFTER
        try:
            self.stdin.write(struct.pack("<Q", len(payload)) + payload)
            self.stdin.flush()
        except (BrokenPipeError, OSError):
            return _LIMIT, "the chat template's process ended before it could render"
        head = self._read(_REPLY.size, deadline)
        if not head:
            return _LIMIT, self._died()
        status, n = _REPLY.unpack(head)
        if n > MAX_REPLY:
            raise RenderLimitError("the chat template's process answered more than its output limit")
        body = self._read(n, deadline)
        if len(body) != n:
            return _LIMIT, self._died()
        return status, body.decode("utf-8", "replace")

    def _died(self) -> str:
        code = self.proc.wait()
        why = {-signal.SIGXCPU: "its CPU time limit", -signal.SIGKILL: "its memory or time limit"}.get(code)
        return f"the chat template's process died ({why or f'exit status {code}'})"


class _Pool:
    def __init__(self, size: int) -> None:
        self.size, self.count, self.idle = size, 0, list[_Worker]()
        self.cond = threading.Condition()

    def acquire(self) -> _Worker:
        deadline = time.monotonic() + KILL_AFTER
        with self.cond:
            while True:
                while self.idle and self.idle[-1].proc.poll() is not None:  # died while idle
                    self.idle.pop().kill()
                    self.count -= 1
                if self.idle:
                    return self.idle.pop()
                if self.count < self.size:
                    break
                if not self.cond.wait(deadline - time.monotonic()):
                    raise RenderLimitError("every chat template worker is busy; retry shortly")
            self.count += 1
        try:
            return _Worker()
        except BaseException:
            self.release(None)
            raise

    def release(self, worker: _Worker | None, healthy: bool = False) -> None:
        """Back to the pool when ``healthy``; otherwise killed (a new one starts when needed)."""
        if worker is not None and not healthy:
            worker.kill()
        with self.cond:
            if worker is not None and healthy:
                self.idle.append(worker)
            else:
                self.count -= 1
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            idle, self.idle = self.idle, []
            self.count -= len(idle)
        for w in idle:
            w.kill()


_pool = _Pool(WORKERS)
atexit.register(lambda: _pool.close())


def _forget_after_fork() -> None:  # a forked child must not share its parent's pipes
    global _pool
    _pool = _Pool(WORKERS)


os.register_at_fork(after_in_child=_forget_after_fork)


def render_isolated(source: str, context: dict[str, Any]) -> str:
    """``source`` rendered with ``context`` in a worker process. Raises what rendering in process would
    (ChatTemplateError, TypeError), and ChatTemplateLimitError when the template ran past a limit."""
    try:
        payload = pickle.dumps((source, context), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"the template's inputs are not plain data: {exc}") from None
    try:
        worker = _pool.acquire()
        healthy = False
        try:
            status, text = worker.render(payload)
            healthy = status in (_OK, _TEMPLATE_ERROR, _TYPE_ERROR)  # after a limit, a fresh process
        finally:
            _pool.release(worker, healthy)
    except RenderLimitError as exc:
        raise ChatTemplateLimitError(f"chat template failed: {exc}") from None
    if status == _OK:
        return text
    if status == _TEMPLATE_ERROR:
        raise ChatTemplateError(text)
    if status == _TYPE_ERROR:
        raise TypeError(text)
    raise ChatTemplateLimitError(text if text.startswith("chat template failed") else f"chat template failed: {text}")


# --- the worker ---------------------------------------------------------------------------------

def _limit_memory() -> None:
    import resource

    with open("/proc/self/statm") as f:
        in_use = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (in_use + MEMORY_BYTES, in_use + MEMORY_BYTES))


def _limit_cpu() -> None:
    """This render's CPU time: a soft limit a little past the deadline (SIGXCPU ends the process)."""
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime + KILL_AFTER) + 2
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _read_exactly(f: Any, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError
    return data


def serve() -> None:
    """The worker's loop: a request on stdin, a reply on stdout, until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a print() anywhere must not corrupt the protocol
    _limit_memory()
    stdout.write(b"R")
    stdout.flush()
    while True:
        try:
            (n,) = struct.unpack("<Q", _read_exactly(stdin, 8))
            source, context = pickle.loads(_read_exactly(stdin, n))
        except EOFError:
            return
        _limit_cpu()
        try:
            status, text = _OK, render_in_process(source, context)
        except RenderLimitError as exc:
            status, text = _LIMIT, str(exc)
        except ChatTemplateError as exc:
            status, text = (_LIMIT if isinstance(exc.__cause__, RenderLimitError) else _TEMPLATE_ERROR), str(exc)
        except MemoryError:
            status, text = _LIMIT, f"the chat template ran past its memory limit ({MEMORY_BYTES >> 20} MiB)"
        except RecursionError:
            status, text = _LIMIT, "the chat template recursed too deeply"
        except TypeError as exc:
            status, text = _TYPE_ERROR, str(exc)
        except Exception as exc:  # noqa: BLE001 - any other failure of a template is the template's
            status, text = _TEMPLATE_ERROR, f"chat template failed: {type(exc).__name__}: {exc}"
        data = text.encode("utf-8", "replace")
        stdout.write(_REPLY.pack(status, len(data)) + data)
        stdout.flush()
        if status == _LIMIT:
            return  # its memory may be fragmented or still held: the parent starts a fresh one
