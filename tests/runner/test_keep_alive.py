"""keep_alive through the daemon (issue 15 #9): huge durations leave every listing working, and keep_alive 0
never unloads a model from under a request that holds it."""
from __future__ import annotations

import threading

import httpx
import ollama

from tests.runner.daemon import Daemon, runlm


def test_huge_keep_alive_keeps_the_listings_working(daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url)
    for keep_alive in (1e20, 10**30, "99999999999h"):
        assert c.generate(model="tinycoder", prompt="", keep_alive=keep_alive).done_reason == "load"
        assert daemon.http.get("/api/ps").status_code == 200
        entry = next(r for r in daemon.ps() if r["model_name"] == "tinycoder:latest")
        assert entry["keep_alive"] == -1 and entry["expires_at"] is None
        ps = runlm(daemon.home, "ps")
        assert ps.returncode == 0 and "tinycoder:latest" in ps.stdout, ps.stderr
    r = daemon.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 1,
                                                  "keep_alive": 1e300})
    assert r.status_code == 200 and daemon.http.get("/engines/ps").status_code == 200
    c.generate(model="tinycoder", prompt="", keep_alive=0)
    assert daemon.wait_unloaded("tinycoder:latest")


def test_keep_alive_zero_waits_for_the_request_that_holds_the_model(daemon: Daemon) -> None:
    c = ollama.Client(host=daemon.url)
    c.generate(model="tinycoder", prompt="", keep_alive="5m")
    pid = daemon.pid_of("tinycoder:latest")
    answers: list[httpx.Response] = []
    body = {"model": "tinycoder", "prompt": "once", "max_tokens": 400, "ignore_eos": True}
    worker = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=120)))
    worker.start()
    while not any(r["in_use"] for r in daemon.ps()):
        pass
    unload = c.generate(model="tinycoder", prompt="", keep_alive=0)  # while the completion holds it
    assert unload.done_reason == "unload"
    assert daemon.pid_of("tinycoder:latest") == pid  # still there, still serving
    worker.join(120)
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["usage"]["completion_tokens"] == 400
    assert daemon.wait_unloaded("tinycoder:latest")  # and gone once the request is done
