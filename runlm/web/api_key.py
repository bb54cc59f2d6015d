"""The API key check of both servers, as pure ASGI middleware (no buffering, so streams and disconnects pass
straight through): ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, compared in constant time."""
from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from runlm.sizes import read_small_text
from runlm.web.asgi import ErrorWriter, openai_error_json, send_error

# serve-engine's routes open without a key: probes and scrapers must not need the secret
OPEN_PATHS = frozenset({"/health", "/liveness", "/readiness", "/metrics", "/version", "/openapi.json", "/docs"})


MAX_KEY_FILE = 1 << 20


def read_api_keys(keys: Sequence[str] | None, key_file: str | None, default: str | None = None) -> tuple[str, ...]:
    """The keys a server takes: each --api-key (a value may list several, comma-separated, as llama-server's),
    then --api-key-file's lines (blank lines and ``#`` comments skipped); ``default`` ($RUNLM_API_KEY) only where
    neither is given. A file that cannot be read, or a key with spaces in it, is a ValueError naming it."""
    found = [k.strip() for value in keys or () for k in value.split(",") if k.strip()]
    if key_file:
        lines = read_small_text(key_file, MAX_KEY_FILE, "--api-key-file").splitlines()
        found += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file {key_file}: holds no key")
    if not found and default:
        found = [default]
    bad = next((k for k in found if any(c.isspace() for c in k)), None)
    if bad is not None:
        raise ValueError("an API key must not contain spaces")
    return tuple(dict.fromkeys(found))


class APIKeyMiddleware:
    """Every route but ``open_paths`` needs one of the keys."""

    def __init__(self, app: ASGIApp, api_key: str | Sequence[str], open_paths: frozenset[str] = OPEN_PATHS,
                 write_error: ErrorWriter = openai_error_json) -> None:
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key)
        self.app, self.keys, self.open_paths, self.write_error = app, [k.encode() for k in keys], open_paths, \
            write_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        # every key compared, whichever matches: the time taken does not tell which one came close
        if given and sum(hmac.compare_digest(given, key) for key in self.keys):
            return await self.app(scope, receive, send)
        message = "Incorrect API key provided." if given else \
            "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'."
        await send_error(send, self.write_error(scope, 401, message, "invalid_api_key"), 401,
                         [(b"www-authenticate", b"Bearer")])
