"""Stalled pulls cannot starve the daemon (issue 15 #6): they run in threads of their own, a few at a time, so
model loads (which use the default executor) go on."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from runlm.store import ModelStore
from tests.runner.daemon import Daemon
from tests.store.file_server import FileServer, Served


def _pull_and_leave(url: str, source: str) -> None:
    try:
        with httpx.stream("POST", f"{url}/api/pull", json={"model": source}, timeout=2) as r:
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError:
        pass


def test_forty_stalled_pulls_leave_model_loads_working(tmp_path: Path, tinycoder_gguf: Path) -> None:
    files = FileServer()
    base = files.start()
    store = ModelStore(tmp_path / "home")
    store.pull("tinycoder")
    d = Daemon(store.home).start()
    try:
        for i in range(40):
            files.files[f"/slow{i}.gguf"] = Served(tinycoder_gguf, delay=60.0)
        clients = [threading.Thread(target=_pull_and_leave, args=(d.url, f"{base}/slow{i}.gguf"))
                   for i in range(40)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        start = time.monotonic()
        r = d.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        assert time.monotonic() - start < 45
        assert d.http.get("/api/tags").status_code == 200
    finally:
        d.stop()  # promptly: stalled downloads do not hold up the daemon's exit
        files.stop()
