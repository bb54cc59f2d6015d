"""Pulls from http(s) URLs (real local server) and from a Hugging Face cache, offline."""
from __future__ import annotations

import hashlib
import io
import os
import shutil
from pathlib import Path

import pytest

from runlm.store import ModelStore
from runlm.store.blobs import BlobDigestError
from runlm.store.download import DownloadError
from runlm.store.progress import ProgressBar, PullProgress
from runlm.store.sources import SourceError, resolve_source
from tests.store.file_server import Served


def test_url_pull_checks_digest_and_names_from_file(store: ModelStore, tinycoder_gguf: Path, file_server) -> None:
    server, url = file_server
    server.files["/models/Tiny-Coder.gguf"] = Served(tinycoder_gguf)
    digest = hashlib.sha256(tinycoder_gguf.read_bytes()).hexdigest()
    model = store.pull(f"{url}/models/Tiny-Coder.gguf#sha256={digest}")
    assert str(model.name) == "tiny-coder:latest"
    assert model.id == store.pull("tinycoder").id  # the same bytes as the built-in package's file
    assert model.manifest["files"][0]["digest"] == f"sha256:{digest}"


def test_wrong_digest_is_refused_and_nothing_stored(store: ModelStore, tinycoder_gguf: Path, file_server) -> None:
    server, url = file_server
    server.files["/m.gguf"] = Served(tinycoder_gguf)
    with pytest.raises(BlobDigestError, match="expected sha256:0000"):
        store.pull(f"{url}/m.gguf#sha256={'0' * 64}")
    assert store.list() == [] and store.blobs.digests() == set()
    assert store.disk_usage()["partial"] == 0  # a wrong file is not kept for resuming


def test_interrupted_pull_lists_nothing_and_resumes(store: ModelStore, tinycoder_gguf: Path, file_server) -> None:
    server, url = file_server
    size = tinycoder_gguf.stat().st_size
    server.files["/m.gguf"] = Served(tinycoder_gguf, cut_after=1_000_000)
    with pytest.raises(DownloadError, match="resume"):
        store.pull(f"{url}/m.gguf")
    assert store.list() == []  # no half model
    assert store.disk_usage()["partial"] == 1_000_000
    model = store.pull(f"{url}/m.gguf")
    assert server.log[-1] == ("/m.gguf", "bytes=1000000-", size - 1_000_000)  # only the rest was fetched
    assert store.model_path(model).read_bytes() == tinycoder_gguf.read_bytes()
    assert store.disk_usage()["partial"] == 0


def test_http_errors_are_clear(store: ModelStore, file_server) -> None:
    _, url = file_server
    with pytest.raises(DownloadError, match="HTTP 404"):
        store.pull(f"{url}/missing.gguf")
    with pytest.raises(SourceError, match="sha256"):
        resolve_source(f"{url}/x.gguf#md5=abc")


def _fake_hf_cache(root: Path, repo: str, files: dict[str, Path]) -> None:
    """The layout huggingface_hub itself writes: blobs, snapshots/<commit>/, refs/main."""
    base = root / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "blobs").mkdir()
    for name, src in files.items():
        blob = base / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, blob)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)


def test_hf_repo_served_from_local_cache_offline(store: ModelStore, tinycoder_gguf: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    _fake_hf_cache(cache, "TestOrg/Tiny-GGUF", {"tiny-Q8_0.gguf": tinycoder_gguf, "tiny-F16.gguf": tinycoder_gguf})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    model = store.pull("hf.co/TestOrg/Tiny-GGUF:f16")
    assert str(model.name) == "testorg/tiny-gguf:latest"
    assert model.info.format == "gguf" and model.manifest["source"]["kind"] == "hf"
    with pytest.raises(SourceError, match="not in the local cache"):
        store.pull("TestOrg/not-cached")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_shows_bytes_rate_and_eta() -> None:
    out = _Terminal()
    bar = ProgressBar(out)
    bar(PullProgress("pulling model.gguf", None, 2_000_000, 1_000_000))
    bar(PullProgress("pulling model.gguf", None, 2_000_000, 2_000_000))
    bar(PullProgress("success"))
    bar.close()
    half, done = out.getvalue().split("\r")[1:3]
    assert " 50% " in half and "1.0 MB/2.0 MB" in half and "B/s" in half and "ETA" in half
    assert "100%" in done and "2.0 MB/2.0 MB" in done
    assert out.getvalue().rstrip().endswith("success")
