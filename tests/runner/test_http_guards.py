"""The daemon against browsers and careless clients (issue 15 #4, #5): Host and Origin checks, JSON content
types for state-changing requests, the body limit and the JSON parser serve-engine uses."""
from __future__ import annotations

import httpx
import pytest

from tests.runner.daemon import Daemon

JSON = {"content-type": "application/json"}


def test_dns_rebinding_host_is_refused(daemon: Daemon) -> None:
    for host in ("evil.example", "evil.example:12434", "192.0.2.7"):
        r = daemon.http.get("/api/tags", headers={"host": host})
        assert r.status_code == 403 and "Host" in r.json()["error"], host
    for host in (f"localhost:{daemon.port}", f"127.0.0.1:{daemon.port}", "localhost"):
        assert daemon.http.get("/api/tags", headers={"host": host}).status_code == 200, host


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/models/create", {"from": "tinycoder", "name": "csrf"}),
    ("POST", "/engines/unload", {"all": True}),
    ("POST", "/engines/_configure", {"model": "tinycoder", "context-size": 64}),
    ("POST", "/api/copy", {"source": "tinycoder", "destination": "csrf"}),
    ("POST", "/v1/completions", {"model": "tinycoder", "prompt": "a", "max_tokens": 1}),
    ("DELETE", "/api/delete", {"model": "tinycoder"}),
])
def test_cross_origin_state_changes_are_refused(daemon: Daemon, method: str, path: str, body: dict) -> None:
    r = daemon.http.request(method, path, json=body, headers={"origin": "https://evil.example"})
    assert r.status_code == 403 and "evil.example" in r.text, r.text
    # the bodies a page can send without a CORS preflight: a form, text/plain
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = daemon.http.request(method, path, content=httpx.Request("POST", "/", json=body).content,
                                headers={"content-type": ctype})
        assert r.status_code == 415, (ctype, r.text)
    assert all(m["tags"] != ["csrf:latest"] for m in daemon.http.get("/models").json())


def test_local_pages_and_reads_are_let_through(daemon: Daemon) -> None:
    r = daemon.http.post("/api/show", json={"model": "tinycoder"}, headers={"origin": "http://localhost:3000"})
    assert r.status_code == 200
    r = daemon.http.get("/api/tags", headers={"origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers  # the page cannot read it


def test_body_limit_and_parser_match_serve_engine(daemon: Daemon) -> None:
    big = b'{"model": "tinycoder", "prompt": "' + b"a" * (33 << 20) + b'"}'
    r = daemon.http.post("/v1/completions", content=big, headers=JSON)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = daemon.http.post("/api/generate", content=big, headers=JSON)
    assert r.status_code == 413 and "limit" in r.json()["error"]

    def chunks():  # no Content-Length: counted as it streams in
        for _ in range(33):
            yield b" " * (1 << 20)
    assert daemon.http.post("/v1/completions", content=chunks(), headers=JSON).status_code == 413
    for raw, text in ((b"[" * 100_000 + b"]" * 100_000, "nested"), (b'{"model": "\xff\xfe"}', "UTF-8"),
                      (b'{"model": "tinycoder", "prompt": "a", "temperature": NaN}', "NaN"),
                      (b'{"model": "tinycoder", "prompt": "a", "temperature": Infinity}', "Infinity")):
        for path in ("/v1/completions", "/api/generate", "/models/create", "/engines/unload"):
            r = daemon.http.post(path, content=raw, headers=JSON)
            assert r.status_code == 400, (path, raw[:40], r.text[:200])
            err = r.json()["error"]
            assert text in (err if isinstance(err, str) else err["message"])
