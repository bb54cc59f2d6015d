"""The chat page of serve-engine (and, by the same router, of the daemon): the page and its static files are
served from the package with the right types and a strict CSP, they fetch nothing from elsewhere, they open
without the API key, and the API calls the script makes answer the way it reads them (with the key, from the
page's own origin, streamed with usage)."""
from __future__ import annotations

import json
import re
from importlib import resources

import httpx
import pytest

from runlm.web.chat_page import ASSETS, PAGE_PATHS
from tests.server.conftest import API_KEY

HTML = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}


def _files() -> dict[str, str]:
    folder = resources.files("runlm.web").joinpath("chat")
    return {p.name: p.read_text() for p in folder.iterdir() if p.is_file()}


def check_page(url: str) -> None:
    """What a browser needs from ``url``'s page (shared with the daemon's test)."""
    page = httpx.get(f"{url}/", headers=HTML)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self';" in csp and "unsafe" not in csp
    assert "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    linked = re.findall(r'(?:src|href)="(/[^"]+)"', page.text)
    assert {"/ui/chat.js", "/ui/chat.css"} <= set(linked)
    imported = {f"/ui/{m}" for text in _files().values() for m in re.findall(r'from "\./([\w.]+)"', text)}
    for path in set(linked) | imported:
        r = httpx.get(f"{url}{path}")
        assert r.status_code == 200 and r.headers["content-type"] == ASSETS[path.rsplit("/", 1)[1]], path
        assert r.headers["content-security-policy"] == csp
    assert httpx.get(f"{url}/").text.endswith("is running")  # not a browser: the plain answer
    for other in ("/ui/..%2f__init__.py", "/ui/index.html", "/ui/"):  # only the listed files (a key may be asked first)
        assert httpx.get(f"{url}{other}").status_code in (401, 404), other


def test_page_files_are_self_contained() -> None:
    files = _files()
    assert set(files) == {"index.html", *ASSETS}
    assert PAGE_PATHS == {"/", *(f"/ui/{n}" for n in ASSETS)}
    for name, text in files.items():
        assert not re.search(r"(?:src|href|import|from|fetch\()\s*=?\s*[\"'](?:https?:)?//", text), name
        assert "innerHTML" not in text and "eval(" not in text, name  # answers are text, never HTML
    assert "<script>" not in files["index.html"] and " style=" not in files["index.html"]  # nothing inline


def test_page_and_the_calls_its_script_makes(smollm2_server) -> None:
    url = smollm2_server.url
    check_page(url)  # open without the key
    calls = set(re.findall(r'fetch\("([^"]+)"', _files()["chat.js"]))
    assert calls == {"/v1/models", "/v1/chat/completions"}
    assert httpx.get(f"{url}/v1/models").status_code == 401  # the page then asks for the key
    key = {"Authorization": f"Bearer {API_KEY}", "Origin": url}
    models = httpx.get(f"{url}/v1/models", headers=key).json()["data"]
    assert models and all("id" in m for m in models)
    body = {"model": models[0]["id"], "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "max_tokens": 5}, headers=key,
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("path", sorted(PAGE_PATHS))
def test_page_paths_need_no_key(smollm2_server, path: str) -> None:
    assert httpx.get(f"{smollm2_server.url}{path}", headers=HTML).status_code == 200
