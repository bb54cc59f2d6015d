"""An API key on the daemon: every route but the liveness ones needs it; the CLI sends $RUNLM_API_KEY."""
from __future__ import annotations

from pathlib import Path

from runlm.store import ModelStore
from tests.runner.daemon import Daemon, runlm


def test_api_key_is_required_and_the_cli_sends_it(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "home")
    store.pull("tinycoder")
    d = Daemon(store.home, ("--api-key", "s3cret")).start()
    try:
        r = d.http.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert d.http.get("/api/tags").status_code == 401
        assert d.http.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert d.http.get("/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200  # issue 15 #11
        assert d.http.get("/v1/models", headers={"x-api-key": "s3cre"}).status_code == 401
        assert d.http.get("/api/tags", headers={"Authorization": "Bearer nope"}).json() == \
            {"error": "Incorrect API key provided."}
        assert runlm(store.home, "ls").returncode == 1
        ok = runlm(store.home, "ls", RUNLM_API_KEY="s3cret")
        assert ok.returncode == 0 and "tinycoder:latest" in ok.stdout
    finally:
        d.stop()


def test_backends_get_the_daemons_own_key_not_the_inherited_one(tmp_path: Path) -> None:
    """Issue 15 #8: with RUNLM_API_KEY in the daemon's environment the Ollama routes got 401 from the backend."""
    store = ModelStore(tmp_path / "home")
    store.pull("tinycoder")
    d = Daemon(store.home, env={"RUNLM_API_KEY": "from-env"}).start()
    key = {"Authorization": "Bearer from-env"}
    try:
        r = d.http.post("/api/generate", json={"model": "tinycoder", "prompt": "a", "stream": False,
                                               "options": {"num_predict": 2}}, headers=key)
        assert r.status_code == 200, r.text
        r = d.http.post("/api/chat", json={"model": "tinycoder", "messages": [{"role": "user", "content": "a"}],
                                           "stream": False, "options": {"num_predict": 2}}, headers=key)
        assert r.status_code == 200, r.text
        r = d.http.post("/v1/completions", json={"model": "tinycoder", "prompt": "a", "max_tokens": 2}, headers=key)
        assert r.status_code == 200, r.text
        pid = d.http.get("/engines/ps", headers=key).json()[0]["pid"]
        env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        assert env["RUNLM_API_KEY"] != "from-env" and len(env["RUNLM_API_KEY"]) >= 32
        assert "from-env" not in Path(f"/proc/{pid}/cmdline").read_text()
    finally:
        d.stop()
