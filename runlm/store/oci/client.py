"""A client for the OCI distribution spec (v1.1) over httpx: blob checks, monolithic and chunked uploads,
cross-repository mounts, manifests by tag or digest, and the auth a registry asks for in its
``WWW-Authenticate`` challenge (Basic; Bearer tokens from its realm, anonymous or with credentials).

Every request has a connect and an idle limit, so a registry that is down or stalls is an error, never a hang.

Why not a library: oras-py (0.2.43, the maintained Python OCI client) has the token flows and chunked uploads,
but no cross-repository mounts, no ranged (resumable) or digest-checked blob downloads, no progress callbacks,
requests without timeouts, and it reads a whole blob into memory for a monolithic upload (models are GBs). The
protocol parts it would save are the small ones here; blob downloads go through the store's own resumable,
digest-checked, time-limited download (runlm/store/download.py).
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin

import httpx

from runlm.store.download import DownloadError, follow_redirect
from runlm.store.oci import media
from runlm.store.oci.credentials import Credentials
from runlm.store.oci.reference import Reference

CHUNK_SIZE = 64 << 20   # blobs larger than this go up in PATCH chunks of this size
READ_SIZE = 1 << 20
MAX_MANIFEST = 4 << 20  # the spec lets registries refuse manifests over 4 MiB; so do we, on the way in
MAX_REPLY = 64 << 10    # error bodies and token replies: what is read of them
MAX_REDIRECTS = 5


class RegistryError(RuntimeError):
    """The registry refused, answered something unexpected, or could not be reached."""


class RegistryAuthError(RegistryError):
    """Missing or wrong credentials, or no permission for the repository."""


@dataclass(slots=True)
class Manifest:
    body: bytes
    media_type: str
    digest: str


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """'Bearer realm="https://auth",service="reg",scope="repository:a:pull"' -> ("bearer", {...})."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}
    return scheme.lower(), params


class RegistryClient:
    def __init__(self, registry: str, creds: Credentials | None = None, insecure: bool = False,
                 connect_timeout: float = 10.0, idle_timeout: float = 60.0, chunk_size: int = CHUNK_SIZE) -> None:
        self.registry = registry
        self.scheme = "http" if insecure else "https"
        self.creds = creds
        self.chunk_size = chunk_size
        self._auth: str | None = None       # the Authorization header that last worked
        self._tokens: dict[str, str] = {}   # scope -> bearer token
        # redirects are followed here (``_send``), so none carries credentials elsewhere or reads a body
        self.http = httpx.Client(timeout=httpx.Timeout(connect_timeout, read=idle_timeout, write=idle_timeout),
                                 follow_redirects=False, headers={"Accept-Encoding": "identity"})

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing -------------------------------------------------------------------------------
    def url(self, ref: Reference, path: str) -> str:
        return f"{self.scheme}://{ref.api_host}/v2/{ref.repository}/{path}"

    def _send(self, method: str, url: str, headers: dict[str, str],
              body: Callable[[], bytes | Iterator[bytes]] | None) -> httpx.Response:
        """One request, its body unread, following redirects as downloads do (runlm/store/download.py)."""
        for _ in range(MAX_REDIRECTS + 1):
            req = self.http.build_request(method, url, headers=headers, content=body() if body else None)
            resp = self.http.send(req, stream=True)
            if not resp.is_redirect:
                return resp
            resp.close()
            try:
                url, headers = follow_redirect(resp, url, headers)
            except DownloadError as exc:
                raise RegistryError(str(exc)) from None
            if resp.status_code == 303 or (resp.status_code in (301, 302) and method not in ("GET", "HEAD")):
                method, body = "GET", None  # as browsers and httpx do
                headers = {k: v for k, v in headers.items() if k.lower() not in ("content-length", "content-type")}
        raise RegistryError(f"{method} {url}: more than {MAX_REDIRECTS} redirects")

    def request(self, method: str, url: str, scope: str, headers: dict[str, str] | None = None,
                body: Callable[[], bytes | Iterator[bytes]] | None = None, stream: bool = False) -> httpx.Response:
        """One request, answering an auth challenge once. ``body`` makes the content afresh for a retry.
        The answer's body is never read here (``stream`` is kept for callers; every answer streams): read it
        with ``read_capped``."""
        for attempt in range(2):
            hdrs = dict(headers or {})
            auth = self._tokens.get(scope) and f"Bearer {self._tokens[scope]}" or self._auth
            if auth:
                hdrs["Authorization"] = auth
            try:
                resp = self._send(method, url, hdrs, body)
            except httpx.ConnectError as exc:
                raise RegistryError(f"cannot reach the registry {self.registry} ({self.scheme}): {exc}") from None
            except httpx.TimeoutException as exc:
                raise RegistryError(f"the registry {self.registry} did not answer in time "
                                    f"({type(exc).__name__})") from None
            except httpx.HTTPError as exc:
                raise RegistryError(f"{method} {url}: {type(exc).__name__}: {exc}") from None
            if resp.status_code != 401 or attempt:
                break
            challenge = resp.headers.get("www-authenticate", "")
            resp.close()
            self._answer(challenge, scope)
        if resp.status_code == 401:
            resp.close()
            raise RegistryAuthError(self._refused())
        if resp.status_code == 403:
            resp.close()
            raise RegistryAuthError(f"the registry {self.registry} denied {method} {url.split('/v2/', 1)[-1]} "
                                    f"(403): the account has no permission for it")
        return resp

    def _refused(self) -> str:
        if self.creds is None:
            return (f"the registry {self.registry} needs credentials: run `runlm login {self.registry}` "
                    f"(or `docker login {self.registry}`)")
        return f"the registry {self.registry} refused the credentials for user {self.creds.username!r} (401)"

    def _answer(self, challenge: str, scope: str) -> None:
        scheme, params = _challenge(challenge)
        if scheme == "basic":
            if self.creds is None:
                raise RegistryAuthError(self._refused())
            self._auth = self.creds.basic()
        elif scheme == "bearer" and params.get("realm"):
            self._tokens[scope] = self._token(params, scope)
        else:
            raise RegistryAuthError(f"the registry {self.registry} asks for auth runlm does not speak: "
                                    f"{challenge[:120]!r}")

    def _token(self, params: dict[str, str], scope: str) -> str:
        """A bearer token from the realm (the distribution token spec): anonymous, or with basic credentials."""
        query: list[tuple[str, str | int | float | bool | None]] = \
            [("service", params["service"])] if params.get("service") else []
        query += [("scope", s) for s in scope.split(" ") if s]
        headers = {"Authorization": self.creds.basic()} if self.creds else {}
        realm = httpx.URL(params["realm"])
        if realm.scheme not in ("http", "https") or (self.scheme == "https" and realm.scheme != "https"):
            raise RegistryAuthError(f"the registry {self.registry} sends for tokens to a {realm.scheme} realm; "
                                    f"refused (credentials never go over plain http from an https registry)")
        try:
            resp = self._send("GET", str(realm.copy_merge_params(query)), headers, None)
            try:
                reply = read_capped(resp, MAX_REPLY) if resp.status_code == 200 else b""
            finally:
                resp.close()
        except httpx.HTTPError as exc:
            raise RegistryError(f"cannot reach the token service of {self.registry} ({params['realm']}): "
                                f"{type(exc).__name__}: {exc}") from None
        except ReplyTooLarge:
            raise RegistryError(f"the token service of {self.registry} answered more than {MAX_REPLY} bytes") from None
        if resp.status_code in (401, 403):
            raise RegistryAuthError(self._refused() if self.creds else
                                    f"the registry {self.registry} gives no anonymous access to {scope}: "
                                    f"run `runlm login {self.registry}`")
        if resp.status_code != 200:
            raise RegistryError(f"the token service of {self.registry} answered HTTP {resp.status_code}")
        try:
            data = json.loads(reply)
            return str(data.get("token") or data["access_token"])
        except (ValueError, KeyError, AttributeError):
            raise RegistryError(f"the token service of {self.registry} answered without a token") from None

    def _fail(self, resp: httpx.Response, what: str) -> RegistryError:
        detail = ""
        try:
            errors = json.loads(read_capped(resp, MAX_REPLY)).get("errors") or []
            detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors if isinstance(e, dict))
        except (ValueError, AttributeError, httpx.HTTPError, httpx.StreamError, ReplyTooLarge):
            pass  # no error body in the spec's shape: the status says it
        resp.close()
        return RegistryError(f"{what}: the registry {self.registry} answered HTTP {resp.status_code}"
                             + (f" ({detail})" if detail else ""))

    def ping(self) -> None:
        """GET /v2/: proves the registry speaks the protocol and takes our credentials (``runlm login``)."""
        url = f"{self.scheme}://{Reference(self.registry, 'x').api_host}/v2/"
        resp = self.request("GET", url, "")
        resp.close()
        if resp.status_code != 200:
            raise self._fail(resp, "checking the login")

    @staticmethod
    def scope(ref: Reference, push: bool = False) -> str:
        return f"repository:{ref.repository}:" + ("pull,push" if push else "pull")

    # --- manifests ------------------------------------------------------------------------------
    def get_manifest(self, ref: Reference, head: bool = False) -> Manifest:
        resp = self.request("HEAD" if head else "GET", self.url(ref, f"manifests/{ref.target}"), self.scope(ref),
                            {"Accept": media.ACCEPT}, stream=True)
        try:
            if resp.status_code == 404:
                raise RegistryError(f"{ref}: no such model in the registry (manifest unknown)")
            if resp.status_code != 200:
                raise self._fail(resp, f"reading the manifest of {ref}")
            mtype = resp.headers.get("content-type", "").split(";")[0].strip()
            body = b""
            if not head:
                for chunk in resp.iter_bytes():
                    body += chunk
                    if len(body) > MAX_MANIFEST:
                        raise RegistryError(f"{ref}: the manifest is larger than {MAX_MANIFEST} bytes")
        finally:
            resp.close()
        digest = "sha256:" + hashlib.sha256(body).hexdigest() if not head else \
            resp.headers.get("docker-content-digest", "")
        if ref.digest and not head and digest != ref.digest:
            raise RegistryError(f"{ref}: the registry sent a manifest whose digest is {digest}")
        return Manifest(body, mtype, digest)

    def put_manifest(self, ref: Reference, body: bytes, media_type: str) -> str:
        resp = self.request("PUT", self.url(ref, f"manifests/{ref.target}"), self.scope(ref, push=True),
                            {"Content-Type": media_type}, body=lambda: body)
        if resp.status_code not in (200, 201):
            raise self._fail(resp, f"writing the manifest of {ref}")
        return resp.headers.get("docker-content-digest", "")

    # --- blobs ----------------------------------------------------------------------------------
    def blob_url(self, ref: Reference, digest: str) -> str:
        return self.url(ref, f"blobs/{digest}")

    def has_blob(self, ref: Reference, digest: str, push: bool = False) -> bool:
        resp = self.request("HEAD", self.blob_url(ref, digest), self.scope(ref, push))
        resp.close()
        if resp.status_code in (200, 404):
            return resp.status_code == 200
        raise self._fail(resp, f"checking blob {digest}")

    def auth_headers(self, ref: Reference) -> dict[str, str]:
        """What a blob download needs to send (after ``has_blob`` has met the challenge)."""
        scope = self.scope(ref)
        auth = self._tokens.get(scope) and f"Bearer {self._tokens[scope]}" or self._auth
        return {"Authorization": auth} if auth else {}

    def mount(self, ref: Reference, digest: str, from_repo: str) -> bool:
        """Cross-repository mount; False when the registry started an ordinary upload instead (it is cancelled)."""
        scope = f"{self.scope(ref, push=True)} repository:{from_repo}:pull"
        url = self.url(ref, f"blobs/uploads/?mount={digest}&from={from_repo}")
        resp = self.request("POST", url, scope)
        resp.close()
        if resp.status_code == 201:
            return True
        if resp.status_code == 202 and resp.headers.get("location"):
            self._cancel(ref, urljoin(url, resp.headers["location"]), scope)
            return False
        raise self._fail(resp, f"mounting blob {digest} from {from_repo}")

    def _cancel(self, ref: Reference, location: str, scope: str) -> None:
        try:
            self.request("DELETE", location, scope).close()
        except RegistryError:
            pass  # an abandoned upload session expires on the registry's side

    def upload(self, ref: Reference, digest: str, path: Path, size: int,
               on_bytes: Callable[[int], None] | None = None) -> None:
        """Upload one blob from a file: one PUT when it is small, PATCH chunks then a closing PUT when large."""
        scope = self.scope(ref, push=True)
        start_url = self.url(ref, "blobs/uploads/")
        resp = self.request("POST", start_url, scope, {"Content-Length": "0"})
        resp.close()
        if resp.status_code != 202 or not resp.headers.get("location"):
            raise self._fail(resp, f"starting the upload of {digest}")
        location = urljoin(start_url, resp.headers["location"])
        if size > self.chunk_size:
            location = self._patch_chunks(ref, location, path, size, scope, on_bytes)
            final_body: Callable[[], bytes | Iterator[bytes]] = lambda: b""  # noqa: E731
            length = 0
        else:
            def final_body() -> Iterator[bytes]:
                yield from _read(path, 0, size, on_bytes)
            length = size
        sep = "&" if "?" in location else "?"
        resp = self.request("PUT", f"{location}{sep}digest={digest}", scope,
                            {"Content-Type": "application/octet-stream", "Content-Length": str(length)},
                            body=final_body)
        resp.close()
        if resp.status_code != 201:
            raise self._fail(resp, f"finishing the upload of {digest}")

    def _patch_chunks(self, ref: Reference, location: str, path: Path, size: int, scope: str,
                      on_bytes: Callable[[int], None] | None) -> str:
        offset = 0
        while offset < size:
            n = min(self.chunk_size, size - offset)
            start = offset

            def body(start: int = start, n: int = n) -> Iterator[bytes]:
                yield from _read(path, start, n, on_bytes)
            resp = self.request("PATCH", location, scope,
                                {"Content-Type": "application/octet-stream", "Content-Length": str(n),
                                 "Content-Range": f"{start}-{start + n - 1}"}, body=body)
            resp.close()
            if resp.status_code != 202 or not resp.headers.get("location"):
                raise self._fail(resp, f"uploading bytes {start}-{start + n - 1} of {path.name}")
            location = urljoin(location, resp.headers["location"])
            offset += n
        return location


class ReplyTooLarge(RegistryError):
    """A registry's answer ran past what runlm reads of such an answer."""


def read_capped(resp: httpx.Response, limit: int) -> bytes:
    """A streamed answer's body, at most ``limit`` bytes: more raises ReplyTooLarge (a Content-Length over the
    limit before anything is read)."""
    length = resp.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ReplyTooLarge(f"{resp.request.url}: an answer of {length} bytes (the limit is {limit})")
    body = bytearray()
    for chunk in resp.iter_raw():
        body += chunk
        if len(body) > limit:
            raise ReplyTooLarge(f"{resp.request.url}: an answer of more than {limit} bytes")
    return bytes(body)


def _read(path: Path, start: int, n: int, on_bytes: Callable[[int], None] | None) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        left = n
        while left:
            chunk = f.read(min(READ_SIZE, left))
            if not chunk:
                raise RegistryError(f"{path}: the file ended {left} bytes early")
            left -= len(chunk)
            if on_bytes:
                on_bytes(len(chunk))
            yield chunk
