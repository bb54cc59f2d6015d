"""What keeps a web page from driving a server on this machine (CSRF and DNS rebinding).

- ``Host`` must name the server: when it is bound to a loopback address, only loopback names and
  addresses (and hosts the operator allows) are answered, so a rebound DNS name is refused.
- A request that changes state (any method but GET, HEAD, OPTIONS) from a browser page of another
  origin is refused: its ``Origin`` must be a loopback origin or one the operator allows.
- A state-changing request with a body must say it is JSON: a form or a ``text/plain`` fetch,
  the bodies a page can send without a CORS preflight, is refused.

The defaults follow Ollama's: loopback origins and hosts are trusted; ``*`` in a list allows any.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from runlm.web.asgi import ErrorWriter, openai_error_json, send_error

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def is_loopback_name(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _hostname(host_header: str) -> str:
    """'example.com:8080' -> 'example.com'; '[::1]:80' -> '::1'."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0].lower()
    return (host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header).lower()


@dataclass(slots=True, frozen=True)
class BrowserPolicy:
    bound_host: str                              # the address the server listens on
    allowed_hosts: frozenset[str] = frozenset()  # extra Host names answered ('*': any)
    allowed_origins: frozenset[str] = frozenset()  # extra Origins that may change state ('*': any)

    def host_ok(self, host_header: str | None) -> bool:
        if "*" in self.allowed_hosts:
            return True
        if not host_header:
            return False  # HTTP/1.1 requires it; every real client sends one
        name = _hostname(host_header)
        if name in self.allowed_hosts or is_loopback_name(name):
            return True
        # bound beyond loopback, the operator chose to be reached by other names (Ollama does the same)
        return not self.allowed_hosts and not is_loopback_name(self.bound_host)

    def origin_ok(self, origin: str | None) -> bool:
        if origin is None or "*" in self.allowed_origins or origin in self.allowed_origins:
            return True  # no Origin: not a browser page (curl, SDKs, the CLI)
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and is_loopback_name(parts.hostname or "")


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BrowserGuardMiddleware:
    def __init__(self, app: ASGIApp, policy: BrowserPolicy, write_error: ErrorWriter = openai_error_json) -> None:
        self.app, self.policy, self.write_error = app, policy, write_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope["method"], headers)
        if refusal is None:
            return await self.app(scope, receive, send)
        status, message, code = refusal
        await send_error(send, self.write_error(scope, status, message, code), status)

    def _refusal(self, method: str, headers: dict[str, str]) -> tuple[int, str, str] | None:
        if not self.policy.host_ok(headers.get("host")):
            return 403, (f"Host {headers.get('host')!r} is not an address of this server; allow it with "
                         f"--allowed-hosts"), "host_not_allowed"
        if method in SAFE_METHODS:
            return None
        if not self.policy.origin_ok(headers.get("origin")):
            return 403, (f"requests from the web page {headers['origin']!r} may not change this server's state; "
                         f"allow the origin with --allowed-origins"), "origin_not_allowed"
        has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        if (has_body or "content-type" in headers) and not _is_json(headers.get("content-type", "")):
            return 415, "the request body must be JSON (Content-Type: application/json)", "unsupported_media_type"
        return None
