"""Bounded downloads (issue 15 #6, #11 and the disk-full fault): time limits, few redirects, partials that are
resumed only when the file is the same and deleted when they cannot be, a full disk that leaves no trace."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runlm.store import ModelStore
from runlm.store.download import DownloadError, DownloadLimits
from tests.store.file_server import Served

ROOT = Path(__file__).resolve().parents[2]


def test_a_silent_server_times_out_and_the_partial_is_kept(tmp_path: Path, tinycoder_gguf: Path, file_server) -> None:
    server, url = file_server
    server.files["/m.gguf"] = Served(tinycoder_gguf, delay=3.0)
    store = ModelStore(tmp_path / "home", DownloadLimits(idle_seconds=1.0))
    start = time.monotonic()
    with pytest.raises(DownloadError, match="resume"):
        store.pull(f"{url}/m.gguf")
    assert time.monotonic() - start < 2.5 and store.list() == []
    assert store.disk_usage()["partial"] == 256 << 10  # what came before the silence


def test_a_slow_download_stops_at_its_overall_limit(tmp_path: Path, tinycoder_gguf: Path, file_server) -> None:
    server, url = file_server
    server.files["/m.gguf"] = Served(tinycoder_gguf, delay=0.4)
    store = ModelStore(tmp_path / "home", DownloadLimits(total_seconds=1.0))
    with pytest.raises(DownloadError, match="longer than 1s"):
        store.pull(f"{url}/m.gguf")
    assert store.list() == []


def test_redirects_are_limited(store: ModelStore, tinycoder_gguf: Path, file_server) -> None:
    server, url = file_server
    server.files["/m.gguf"] = Served(tinycoder_gguf)
    for i in range(8):
        server.files[f"/r{i}"] = Served(tinycoder_gguf, redirect_to=f"/r{i + 1}" if i < 7 else "/m.gguf")
    assert store.pull(f"{url}/r5", name="two-hops").id  # r5 -> r6 -> r7 -> m.gguf
    with pytest.raises(DownloadError, match="more than 5 redirects"):
        store.pull(f"{url}/r0")


def test_a_refused_resume_deletes_the_partial(store: ModelStore, tinycoder_gguf: Path, file_server) -> None:
    server, url = file_server
    server.files["/m.gguf"] = Served(tinycoder_gguf, cut_after=1_000_000)
    with pytest.raises(DownloadError):
        store.pull(f"{url}/m.gguf")
    assert store.disk_usage()["partial"] == 1_000_000
    del server.files["/m.gguf"]
    with pytest.raises(DownloadError, match="HTTP 404"):
        store.pull(f"{url}/m.gguf")
    assert store.disk_usage()["partial"] == 0 and not any(store.partial.iterdir())


def test_a_changed_file_is_fetched_whole_not_spliced(store: ModelStore, tinycoder_gguf: Path, file_server) -> None:
    server, url = file_server
    server.files["/m.gguf"] = Served(tinycoder_gguf, cut_after=1_000_000)
    with pytest.raises(DownloadError):
        store.pull(f"{url}/m.gguf")
    server.files["/m.gguf"].etag = '"v2"'  # the file changed on the server meanwhile
    model = store.pull(f"{url}/m.gguf")
    assert server.log[-1] == ("/m.gguf", "bytes=1000000-", tinycoder_gguf.stat().st_size)  # sent whole (200)
    assert store.model_path(model).read_bytes() == tinycoder_gguf.read_bytes()


def test_a_resume_at_the_wrong_offset_is_refused(store: ModelStore, tinycoder_gguf: Path, file_server) -> None:
    server, url = file_server
    server.files["/m.gguf"] = Served(tinycoder_gguf, cut_after=1_000_000, content_range_start=0)
    with pytest.raises(DownloadError):
        store.pull(f"{url}/m.gguf")
    with pytest.raises(DownloadError, match="wrong place"):
        store.pull(f"{url}/m.gguf")
    assert store.disk_usage()["partial"] == 0
    server.files["/m.gguf"].content_range_start = None
    assert store.model_path(store.pull(f"{url}/m.gguf")).read_bytes() == tinycoder_gguf.read_bytes()


def test_without_a_validator_a_partial_is_not_trusted(store: ModelStore, tinycoder_gguf: Path, file_server) -> None:
    server, url = file_server
    server.files["/m.gguf"] = Served(tinycoder_gguf, cut_after=1_000_000, etag=None)
    with pytest.raises(DownloadError):
        store.pull(f"{url}/m.gguf")
    store.pull(f"{url}/m.gguf")
    assert server.log[-1][1] is None  # started over, no Range


def test_stale_partials_are_deleted(store: ModelStore, tinycoder_gguf: Path, file_server) -> None:
    server, url = file_server
    server.files["/m.gguf"] = Served(tinycoder_gguf)
    store.partial.mkdir(parents=True)
    old = store.partial / "0123.partial"
    old.write_bytes(b"x" * 1000)
    os.utime(old, (time.time() - 8 * 86400,) * 2)
    store.pull(f"{url}/m.gguf")
    assert not old.exists()


_PULL_WITH_SMALL_DISK = """
import resource, signal, sys
from runlm.store import ModelStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))
try:
    ModelStore(sys.argv[1]).pull(sys.argv[2])
except Exception as exc:
    print(type(exc).__name__, exc)
    sys.exit(3)
"""


def test_a_full_disk_leaves_the_store_consistent_and_says_so(tmp_path: Path, tinycoder_gguf: Path,
                                                             file_server) -> None:
    server, url = file_server
    server.files["/m.gguf"] = Served(tinycoder_gguf)
    home = tmp_path / "home"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", _PULL_WITH_SMALL_DISK, str(home), f"{url}/m.gguf"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 3 and "disk is full" in res.stdout, res.stdout + res.stderr
    store = ModelStore(home)
    assert store.list() == [] and store.blobs.digests() == set()
    assert store.disk_usage() == {"models": 0, "partial": 0}
    assert store.model_path(store.pull(f"{url}/m.gguf")).read_bytes() == tinycoder_gguf.read_bytes()
