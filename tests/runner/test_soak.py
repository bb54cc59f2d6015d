"""Soak (issue 15; slow: `make test-slow`): 64 concurrent streaming clients against `runlm serve` for
RUNLM_SOAK_SECONDS (default 600). Every response must be complete, and the daemon's and the backend's RSS must
stay within 10% of their level after warm-up, with no leaked file descriptors or threads."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from runlm.store import ModelStore
from tests.runner.daemon import Daemon

CLIENTS = 64
SECONDS = float(os.environ.get("RUNLM_SOAK_SECONDS", "600"))


def _usage(proc: psutil.Process) -> tuple[int, int, int]:
    return proc.memory_info().rss, proc.num_fds(), proc.num_threads()


def _client(url: str, stop: threading.Event, done: list[int], broken: list[str]) -> None:
    with httpx.Client(base_url=url, timeout=120) as http:
        while not stop.is_set():
            body = {"model": "tinycoder", "prompt": "once", "max_tokens": 24, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            tokens, finished = 0, False
            try:
                with http.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if chunk.get("usage"):
                                tokens = chunk["usage"]["completion_tokens"]
                            finished = finished or any(c["finish_reason"] == "length" for c in chunk["choices"])
                        elif line == "data: [DONE]" and finished:
                            done.append(tokens)
                            break
                    else:
                        broken.append(f"HTTP {r.status_code}, stream ended without [DONE]")
            except httpx.HTTPError as exc:
                broken.append(f"{type(exc).__name__}: {exc}")


def _run_clients(url: str, seconds: float, done: list[int], broken: list[str]) -> None:
    stop = threading.Event()
    threads = [threading.Thread(target=_client, args=(url, stop, done, broken)) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(180)
    time.sleep(2)  # the last connections closed on both sides


@pytest.mark.slow
def test_64_streaming_clients_for_ten_minutes(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "home")
    store.pull("tinycoder")
    d = Daemon(store.home).start()
    done: list[int] = []
    broken: list[str] = []
    try:
        # warm-up: the model loaded, caches and pools at their working size; then measured idle, before and after
        _run_clients(d.url, min(60.0, SECONDS / 5), done, broken)
        daemon, backend = psutil.Process(d.proc.pid), psutil.Process(d.pid_of("tinycoder:latest"))
        before = [_usage(daemon), _usage(backend)]
        _run_clients(d.url, SECONDS, done, broken)
        after = [_usage(daemon), _usage(backend)]
    finally:
        d.stop()
    print(f"soak: {len(done)} streams complete, {len(broken)} broken in {SECONDS:.0f}s; "
          f"(rss, fds, threads) daemon {before[0]} -> {after[0]}, backend {before[1]} -> {after[1]}")
    assert not broken, broken[:5]
    assert done and all(n == 24 for n in done)
    for (rss0, fds0, thr0), (rss1, fds1, thr1) in zip(before, after):
        assert rss1 <= rss0 * 1.10, f"RSS grew {rss0} -> {rss1}"
        # idle keep-alive connections between daemon and backend stay pooled (httpx keeps up to 20): a leak
        # would be one per request, thousands over a soak
        assert fds1 <= fds0 + 24 and thr1 <= thr0 + 4, f"fds {fds0} -> {fds1}, threads {thr0} -> {thr1}"
