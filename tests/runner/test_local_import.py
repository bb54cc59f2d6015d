"""Local files over the daemon's HTTP API (issue 15 #2): refused unless `--allow-local-import DIR`, and then only
under DIR; the CLI imports local files itself."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import ollama

from runlm.store import ModelStore
from runlm.store.sources import LOCAL_REFUSED
from tests.runner.daemon import Daemon, runlm


def _create(daemon: Daemon, source: str) -> dict:
    """The last line of a create's stream; a refusal comes before any stream, as a 4xx (issue 31)."""
    r = daemon.http.post("/models/create", json={"from": source})
    if r.status_code >= 400:
        assert 400 <= r.status_code < 500, r.text
        return {"type": "error", "message": r.json()["error"]["message"]}
    return json.loads(r.text.splitlines()[-1])


def test_http_pulls_read_no_local_file(daemon: Daemon, tinycoder_gguf: Path, qwen2_dir: Path) -> None:
    before = {m.id for m in ModelStore(daemon.home).list()}
    answers = set()
    for path in ("/etc/shadow", "/etc/passwd", "/no/such/file.gguf", str(tinycoder_gguf), str(qwen2_dir)):
        r = daemon.http.post("/api/pull", json={"model": path, "stream": False})
        assert r.status_code == 400
        answers.add(r.json()["error"])
        assert _create(daemon, path) == {"type": "error", "message": LOCAL_REFUSED}
    assert answers == {LOCAL_REFUSED}  # nothing tells whether a path exists
    with_client = ollama.Client(host=daemon.url)
    try:
        with_client.pull(str(tinycoder_gguf))
        raise AssertionError("the pull was not refused")
    except ollama.ResponseError as exc:
        assert exc.status_code == 400
    assert {m.id for m in ModelStore(daemon.home).list()} == before


def test_cli_imports_a_local_file_while_the_daemon_runs(daemon: Daemon, tinycoder_gguf: Path, tmp_path: Path) -> None:
    copy = tmp_path / "mine.gguf"
    shutil.copy(tinycoder_gguf, copy)
    res = runlm(daemon.home, "pull", str(copy), "--name", "cli-local")
    assert res.returncode == 0, res.stderr
    assert any("cli-local:latest" in m["tags"] for m in daemon.http.get("/models").json())


def test_allow_local_import_reads_only_under_its_folder(tmp_path: Path, tinycoder_gguf: Path) -> None:
    allowed = tmp_path / "imports"
    allowed.mkdir()
    shutil.copy(tinycoder_gguf, allowed / "coder.gguf")
    (allowed / "link.gguf").symlink_to(tinycoder_gguf)
    d = Daemon(tmp_path / "home", ("--allow-local-import", str(allowed))).start()
    try:
        assert _create(d, str(allowed / "coder.gguf"))["type"] == "success"
        for path in (str(tinycoder_gguf), str(allowed / "link.gguf"), str(allowed / ".." / "x.gguf"), "/etc/passwd"):
            assert _create(d, path) == {"type": "error", "message": LOCAL_REFUSED}
            assert d.http.post("/api/pull", json={"model": path, "stream": False}).status_code == 400
    finally:
        d.stop()
