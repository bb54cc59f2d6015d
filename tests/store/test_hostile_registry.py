"""A registry is untrusted (issue 33, finding 3): a blob is cut off at the size its manifest declared and refused
on a Content-Length that disagrees, error bodies and token replies are read at most 64 KiB, a failed pull keeps
no more than a resume needs, and credentials never follow a redirect to another scheme, host or port.

The registry here is a small fake one on 127.0.0.1 that misbehaves on purpose; a pull of it as it should be
also works, so each refusal below is the refusal, not a fake that cannot be pulled at all."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from runlm.store import ModelStore
from runlm.store.download import DownloadError, follow_redirect
from runlm.store.oci import credentials, media
from runlm.store.oci.client import MAX_REPLY, RegistryError
from runlm.store.oci.transfer import inspect_remote, pull

MiB = 1 << 20


class FakeRegistry:
    """Serves one model (repository ``m``, tag ``t``): a config blob and one GGUF layer. ``blob`` decides how
    the layer's bytes are sent; ``manifest_status``/``manifest_error_bytes`` make the manifest GET fail with a
    large body; ``token_bytes`` makes a bearer realm answer that many bytes; ``basic`` asks for Basic auth;
    ``redirect_to`` sends blob GETs to another server."""

    def __init__(self, gguf: bytes) -> None:
        self.gguf = gguf
        self.config = json.dumps({"config": {}}).encode()
        self.blob = "honest"
        self.declared = len(gguf)
        self.manifest_status = 200
        self.manifest_error_bytes = 0
        self.config_extra = 0
        self.token_bytes = 0
        self.basic = False
        self.redirect_to: str | None = None
        self.sent: dict[str, int] = {}   # path -> bytes written before the client went away
        self.auth_seen: list[str | None] = []

    def digest(self, data: bytes) -> str:
        return "sha256:" + hashlib.sha256(data).hexdigest()

    def manifest(self) -> bytes:
        return json.dumps({
            "schemaVersion": 2, "mediaType": media.OCI_MANIFEST,
            "config": {"mediaType": media.DMR_CONFIG_V01, "digest": self.digest(self.config), "size": len(self.config)},
            "layers": [{"mediaType": media.DMR_GGUF, "digest": self.digest(self.gguf), "size": self.declared}],
        }).encode()

    def start(self) -> str:
        reg = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _stream(self, status: int, total: int, content_length: int | None, fill: bytes = b"x",
                        headers: dict[str, str] | None = None) -> None:
                """``total`` bytes of ``fill`` (bounded; stops when the client goes away)."""
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if content_length is not None:
                    self.send_header("Content-Length", str(content_length))
                else:
                    self.send_header("Connection", "close")
                self.end_headers()
                chunk, sent = fill * ((64 << 10) // len(fill) + 1), 0
                try:
                    while sent < total:
                        piece = chunk[:total - sent]
                        self.wfile.write(piece)
                        sent += len(piece)
                except OSError:
                    pass
                reg.sent[self.path] = sent
                self.close_connection = True

            def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self) -> None:  # noqa: N802
                self.do_GET()

            def do_GET(self) -> None:  # noqa: N802
                reg.auth_seen.append(self.headers.get("Authorization"))
                if self.path.startswith("/token"):
                    return self._stream(200, reg.token_bytes, reg.token_bytes, b'{"token": "' + b"a" * 1000)
                if reg.token_bytes and not (self.headers.get("Authorization") or "").startswith("Bearer"):
                    realm = f"http://127.0.0.1:{self.server.server_address[1]}/token"
                    return self._send(401, b"", {"WWW-Authenticate": f'Bearer realm="{realm}",service="fake"'})
                if reg.basic and not (self.headers.get("Authorization") or "").startswith("Basic"):
                    return self._send(401, b"", {"WWW-Authenticate": 'Basic realm="fake"'})
                if self.path == "/v2/":
                    return self._send(200, b"{}")
                if self.path.startswith("/v2/m/manifests/"):
                    if reg.manifest_status != 200:
                        return self._stream(reg.manifest_status, reg.manifest_error_bytes, reg.manifest_error_bytes)
                    return self._send(200, reg.manifest(), {"Content-Type": media.OCI_MANIFEST})
                if self.path == f"/v2/m/blobs/{reg.digest(reg.config)}":
                    if reg.config_extra:  # the config blob runs on past its declared size
                        return self._stream(200, len(reg.config) + reg.config_extra, None)
                    return self._send(200, reg.config)
                if self.path == f"/v2/m/blobs/{reg.digest(reg.gguf)}":
                    if self.command == "HEAD":
                        return self._send(200, b"")
                    if reg.redirect_to:
                        return self._send(307, b"", {"Location": reg.redirect_to})
                    if reg.blob == "honest":
                        return self._send(200, reg.gguf)
                    if reg.blob == "endless":  # no Content-Length, far past the declared size (bounded here)
                        return self._stream(200, 256 * MiB, None)
                    if reg.blob == "wrong-length":
                        return self._stream(200, 256 * MiB, 256 * MiB)
                    if reg.blob == "cut":  # half the bytes, then the connection drops
                        self.send_response(200)
                        self.send_header("Content-Length", str(len(reg.gguf)))
                        self.end_headers()
                        self.wfile.write(reg.gguf[:len(reg.gguf) // 2])
                        self.close_connection = True
                        return None
                return self._send(404, b"")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def registry(tinycoder_gguf: Path) -> Iterator[tuple[FakeRegistry, str]]:
    reg = FakeRegistry(tinycoder_gguf.read_bytes())
    host = reg.start()
    yield reg, host
    reg.stop()


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelStore:
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker"))
    return ModelStore(tmp_path / "home")


def _partial_bytes(store: ModelStore) -> int:
    return sum(p.stat().st_size for p in store.partial.glob("*")) if store.partial.is_dir() else 0


def _peak(call: Callable[[], object]) -> tuple[float, int, BaseException | None]:
    tracemalloc.start()
    t0 = time.monotonic()
    exc = None
    try:
        call()
    except BaseException as e:  # noqa: BLE001 - returned to the test
        exc = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return time.monotonic() - t0, peak, exc


def _sent(reg: FakeRegistry, path: str) -> int:
    """The bytes the registry wrote for ``path``: its handler records them on its own thread once the client has
    gone, which may be after the client's call returned (waited for, 5 s at most)."""
    deadline = time.monotonic() + 5
    while path not in reg.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    return reg.sent[path]


def test_an_honest_registry_pulls(registry, store: ModelStore) -> None:
    _, host = registry
    model = pull(store, f"{host}/m:t", insecure=True)
    assert model.manifest["files"][0]["size"] > 0 and _partial_bytes(store) == 0


def test_a_blob_past_its_declared_size_is_cut_off_there(registry, store: ModelStore) -> None:
    # before: a 100-byte layer whose blob streamed 300 MiB wrote 306,501,007 bytes, then failed on the digest
    reg, host = registry
    reg.blob, reg.declared = "endless", 100
    elapsed, _, exc = _peak(lambda: pull(store, f"{host}/m:t", insecure=True))
    assert isinstance(exc, DownloadError) and "more than the 100 bytes declared" in str(exc), exc
    assert _partial_bytes(store) == 0 and store.list() == []  # nothing kept: not even the 100 bytes
    assert elapsed < 5 and _sent(reg, f"/v2/m/blobs/{reg.digest(reg.gguf)}") < 64 * MiB


def test_a_content_length_that_disagrees_is_refused_before_a_byte_is_written(registry, store: ModelStore) -> None:
    reg, host = registry
    reg.blob = "wrong-length"
    with pytest.raises(DownloadError, match=f"announces {256 * MiB} bytes, but {len(reg.gguf)} were declared"):
        pull(store, f"{host}/m:t", insecure=True)
    assert _partial_bytes(store) == 0


def test_a_dropped_connection_keeps_only_what_a_resume_needs(registry, store: ModelStore) -> None:
    reg, host = registry
    reg.blob = "cut"
    with pytest.raises(DownloadError, match="resume"):
        pull(store, f"{host}/m:t", insecure=True)
    assert 0 < _partial_bytes(store) <= len(reg.gguf) // 2 + 16  # (the validator file: a few bytes)
    # an interrupted download nobody resumed for a week is deleted by the next pull
    old = time.time() - 8 * 86400
    stale = store.partial / ("sha256-" + "0" * 64 + ".partial")
    stale.write_bytes(b"x" * 1000)
    os.utime(stale, (old, old))
    reg.blob = "honest"
    pull(store, f"{host}/m:t", insecure=True)
    assert not stale.exists() and _partial_bytes(store) == 0


def test_a_huge_error_body_is_read_64_kib_at_most(registry, store: ModelStore) -> None:
    # before: a 300 MiB 500-reply to the manifest GET took the process to 673 MiB
    reg, host = registry
    reg.manifest_status, reg.manifest_error_bytes = 500, 256 * MiB
    elapsed, peak, exc = _peak(lambda: pull(store, f"{host}/m:t", insecure=True))
    assert isinstance(exc, RegistryError) and "HTTP 500" in str(exc), exc
    assert peak < 4 * MiB and elapsed < 5


def test_a_huge_token_reply_is_refused(registry, store: ModelStore) -> None:
    reg, host = registry
    reg.token_bytes = 256 * MiB
    elapsed, peak, exc = _peak(lambda: pull(store, f"{host}/m:t", insecure=True))
    assert isinstance(exc, RegistryError) and f"more than {MAX_REPLY} bytes" in str(exc), exc
    assert peak < 4 * MiB and elapsed < 5


def test_a_modest_token_reply_still_works(registry, store: ModelStore) -> None:
    reg, host = registry
    reg.token_bytes = 2000  # '{"token": "aaa...' cut at 2000 bytes is not JSON: a clean refusal, not a crash
    with pytest.raises(RegistryError, match="without a token"):
        pull(store, f"{host}/m:t", insecure=True)


def test_a_config_is_read_at_its_declared_size(registry, store: ModelStore) -> None:
    reg, host = registry
    reg.config_extra = 64 * MiB  # the config blob runs on: inspect reads its declared size, then stops
    elapsed, peak, exc = _peak(lambda: inspect_remote(store, f"{host}/m:t", insecure=True))
    assert exc is None and peak < 4 * MiB and elapsed < 5


def test_credentials_do_not_follow_a_redirect_to_another_port(registry, store: ModelStore) -> None:
    # before: after `runlm login 127.0.0.1:A`, a 307 to 127.0.0.1:B sent `Authorization: Basic ...` there
    reg, host = registry
    other = FakeRegistry(reg.gguf)
    other_host = other.start()
    try:
        credentials.save(host, credentials.Credentials("user", "s3cret"), store.home)
        reg.basic = True
        reg.redirect_to = f"http://{other_host}/v2/m/blobs/{reg.digest(reg.gguf)}"
        pull(store, f"{host}/m:t", insecure=True)
        assert any(a and a.startswith("Basic") for a in reg.auth_seen)  # the registry itself got them
        assert other.auth_seen == [None]  # the other port did not
    finally:
        other.stop()


@pytest.mark.parametrize("source, target, keeps_auth", [
    ("https://r.example/a", "https://r.example/b", True),
    ("https://r.example/a", "https://r.example:8443/b", False),
    ("https://r.example/a", "https://s.example/b", False),
    ("http://r.example/a", "https://r.example/b", False),
])
def test_authorization_goes_to_the_same_origin_only(source: str, target: str, keeps_auth: bool) -> None:
    resp = httpx.Response(307, headers={"Location": target}, request=httpx.Request("GET", source))
    resp.next_request = httpx.Request("GET", target)
    url, headers = follow_redirect(resp, source, {"Authorization": "Basic x", "Accept": "*/*"})
    assert url == target and ("Authorization" in headers) == keeps_auth and headers["Accept"] == "*/*"


@pytest.mark.parametrize("target", ["http://r.example/b", "file:///etc/passwd"])
def test_https_never_follows_to_http(target: str) -> None:
    resp = httpx.Response(307, headers={"Location": target}, request=httpx.Request("GET", "https://r.example/a"))
    resp.next_request = httpx.Request("GET", target)
    with pytest.raises(DownloadError, match="refusing a redirect"):
        follow_redirect(resp, "https://r.example/a", {})
