"""The chat page at ``/`` of both servers: static files shipped in the package (runlm/web/chat/), no build step,
nothing fetched from elsewhere, served under a strict Content-Security-Policy (scripts, styles and requests
from this origin only, no inline script, no framing). A client that does not ask for HTML (curl, health
probes, Ollama's clients) still gets the plain "... is running" answer at ``/``."""
from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

ASSETS = {"chat.js": "text/javascript; charset=utf-8", "markdown.js": "text/javascript; charset=utf-8",
          "highlight.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}
# the page and its assets hold no secret: they open without the API key (the page asks for it)
PAGE_PATHS = frozenset({"/", *(f"/ui/{name}" for name in ASSETS)})
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


@functools.cache
def _file(name: str) -> bytes:
    return resources.files("runlm.web").joinpath("chat", name).read_bytes()


def page_router(running_text: str) -> APIRouter:
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def root(request: Request) -> Response:
        if "text/html" not in request.headers.get("accept", ""):
            return PlainTextResponse(running_text)
        return Response(_file("index.html"), media_type="text/html; charset=utf-8", headers=HEADERS)

    @router.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:  # a fixed list: no path from the request reaches the file system
            return PlainTextResponse(f"no file {name!r}", status_code=404)
        return Response(_file(name), media_type=ASSETS[name], headers=HEADERS)

    return router
