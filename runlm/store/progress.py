"""Pull progress: events from the store, a terminal progress bar for the CLI."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TextIO


@dataclass(slots=True)
class PullProgress:
    status: str              # Ollama's words: "pulling manifest", "pulling <digest>", "verifying ...", "success"
    digest: str | None = None
    total: int = 0
    completed: int = 0

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, 0) or k == "status"}


ProgressCallback = Callable[[PullProgress], None]


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def human_duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressBar:
    """Renders PullProgress events as one updating line per phase: bytes, rate and ETA."""

    def __init__(self, out: TextIO = sys.stderr, width: int = 25) -> None:
        self.out, self.width = out, width
        self._status: str | None = None
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._tty = out.isatty()
        self._done_shown = False

    def __call__(self, p: PullProgress) -> None:
        if p.status != self._status:
            if self._status is not None:
                self.out.write("\n")
            self._status, self._start = p.status, time.monotonic()
            self._last_draw = 0.0
            self._done_shown = False
        now = time.monotonic()
        done = bool(p.total) and p.completed >= p.total
        if done and self._done_shown:
            return
        self._done_shown = done
        if not p.total:
            self.out.write(f"\r{p.status}")
        elif self._tty and now - self._last_draw < 0.1 and not done:
            return
        else:
            elapsed = max(now - self._start, 1e-6)
            rate = p.completed / elapsed
            frac = min(p.completed / p.total, 1.0)
            bar = "█" * int(frac * self.width)
            eta = human_duration((p.total - p.completed) / rate) if rate > 0 and not done else "0s"
            line = (f"\r{p.status[:40]:<40} {frac:4.0%} ▕{bar:<{self.width}}▏ "
                    f"{human_bytes(p.completed)}/{human_bytes(p.total)}  {human_bytes(rate)}/s  ETA {eta}")
            if not self._tty and not done:
                return  # in a log, only the final line of each phase
            self.out.write(line)
        self._last_draw = now
        self.out.flush()

    def close(self) -> None:
        if self._status is not None:
            self.out.write("\n")
            self.out.flush()
