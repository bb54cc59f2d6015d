"""How CLI commands reach a running daemon, and the tables they print."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any, Literal, overload

from runlm.runner.daemon import find_daemon


class CLIError(Exception):
    """A failure to report in one line, with exit status ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def error_message(resp: Any) -> str:
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        return f"HTTP {resp.status_code}: {resp.text[:300]}"
    return err.get("message", str(err)) if isinstance(err, dict) else str(err)


def ssl_context(certificate: str) -> Any:
    import ssl

    return ssl.create_default_context(cafile=certificate)


class Daemon:
    def __init__(self, url: str, shares_store: bool = False, certificate: str | None = None) -> None:
        import httpx

        self.url = url
        self.shares_store = shares_store  # found through this RUNLM_HOME's daemon.json, not RUNLM_HOST
        key = os.environ.get("RUNLM_API_KEY")
        # an HTTPS daemon of this home: its own certificate is trusted (it may be self-signed); $SSL_CERT_FILE
        # or the system's CAs otherwise
        verify: Any = ssl_context(certificate) if certificate else True
        self.http = httpx.Client(base_url=url, timeout=httpx.Timeout(None, connect=5.0), verify=verify,
                                 headers={"Authorization": f"Bearer {key}"} if key else None)

    def call(self, method: str, path: str, body: dict | None = None, **params: Any) -> Any:
        resp = self.http.request(method, path, json=body, params=params or None)
        if resp.status_code >= 400:
            raise CLIError(error_message(resp))
        return resp.json() if resp.content else None

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        with self.http.stream("POST", path, json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise CLIError(error_message(resp))
            for line in resp.iter_lines():
                if line.strip():
                    yield json.loads(line)


@overload
def connect(required: Literal[True]) -> Daemon: ...
@overload
def connect(required: bool = False) -> Daemon | None: ...
def connect(required: bool = False) -> Daemon | None:
    """The daemon for this RUNLM_HOME (or RUNLM_HOST), if one answers."""
    import httpx

    found = find_daemon()
    if found is not None:
        daemon = Daemon(found.url, shares_store=found.pid is not None, certificate=found.certificate)
        try:
            daemon.http.get("/", timeout=3.0)
            return daemon
        except httpx.HTTPError:
            pass
    if required:
        raise CLIError("no runlm daemon is running; start one with: runlm serve")
    return None


def print_table(rows: list[list[str]], headers: list[str], out=sys.stdout) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    for row in [headers, *rows]:
        out.write("    ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))
