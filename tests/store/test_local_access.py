"""Which local files a pull may read (issue 15 #2): over HTTP none, unless the daemon names a folder; then
only files under it once links are resolved. Blobs are for the store's owner alone."""
from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest

from runlm.store import ModelStore
from runlm.store.sources import LOCAL_REFUSED, LocalAccess, SourceError


def test_without_a_folder_no_local_path_is_read_and_none_is_told_apart(store: ModelStore, tmp_path: Path,
                                                                       tinycoder_gguf: Path) -> None:
    messages = []
    for path in ("/etc/shadow", "/etc/passwd", str(tinycoder_gguf), str(tmp_path / "none.gguf"), "./x", "~/m"):
        with pytest.raises(SourceError) as exc:
            store.pull(path, access=LocalAccess())
        messages.append(str(exc.value))
    assert set(messages) == {LOCAL_REFUSED}  # the same words whether the file exists or not
    assert store.list() == [] and not store.blobs.digests()


def test_under_an_allowed_folder_only(store: ModelStore, tmp_path: Path, tinycoder_gguf: Path,
                                      qwen_dir: Path) -> None:
    allowed = tmp_path / "imports"
    allowed.mkdir()
    shutil.copy(tinycoder_gguf, allowed / "coder.gguf")
    access = LocalAccess.under(allowed)
    assert store.pull(str(allowed / "coder.gguf"), access=access).info.architecture == "llama"
    assert store.pull("coder.gguf", name="rel", access=access).id  # relative to the folder
    (allowed / "escape.gguf").symlink_to(tinycoder_gguf)  # a link out of the folder
    (allowed / "up").symlink_to(tinycoder_gguf.parent)
    outside = [str(tinycoder_gguf), str(allowed / "escape.gguf"), str(allowed / "../imports/escape.gguf"),
               "up/" + tinycoder_gguf.name, "/etc/passwd", str(tmp_path / "no-such.gguf")]
    for path in outside:
        with pytest.raises(SourceError, match="cannot be pulled over HTTP"):
            store.pull(path, access=access)
    model_dir = allowed / "model"
    shutil.copytree(qwen_dir, model_dir)
    (model_dir / "stolen.txt").symlink_to("/etc/passwd")  # a link inside a model folder, leading out
    with pytest.raises(SourceError, match="stolen.txt: a symbolic link that leaves"):
        store.pull(str(model_dir), access=access)
    (model_dir / "stolen.txt").unlink()
    assert store.pull(str(model_dir), name="qwen-dir", access=access).manifest["layout"] == "dir"


def test_blobs_are_not_world_readable(store: ModelStore, tmp_path: Path, tinycoder_gguf: Path) -> None:
    store.pull(str(tinycoder_gguf))
    for digest in store.blobs.digests():
        mode = stat.S_IMODE(store.blobs.path(digest).stat().st_mode)
        assert mode & 0o077 == 0 and mode & 0o222 == 0, oct(mode)
    assert stat.S_IMODE(store.blobs.root.stat().st_mode) & 0o077 == 0


@pytest.fixture
def qwen_dir(tiny_model) -> Path:
    return tiny_model("qwen2")


# --- issue 33, finding 4: one handle per file, no read before the check, no content in errors -------------

def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.write_bytes(b"TOPSECRETpassword-do-not-store" * 4)
    secret.chmod(0o600)
    return secret


def test_a_link_out_is_refused_before_it_is_read(store: ModelStore, tmp_path: Path, qwen_dir: Path) -> None:
    # before: inspect_model read the link first and said "safetensors header of 4995128901736877908 bytes"
    secret = _secret(tmp_path)
    allowed = tmp_path / "imports"
    shutil.copytree(qwen_dir, allowed / "model")
    (allowed / "model" / "x.safetensors").symlink_to(secret)
    with pytest.raises(SourceError) as exc:
        store.pull(str(allowed / "model"), access=LocalAccess.under(allowed))
    message = str(exc.value)
    assert "x.safetensors: a symbolic link that leaves" in message
    assert str(int.from_bytes(secret.read_bytes()[:8], "little")) not in message and "SECRET" not in message
    assert store.list() == [] and not store.blobs.digests()


def test_a_layout_and_links_that_stay_inside(store: ModelStore, tmp_path: Path, tinycoder_gguf: Path,
                                             qwen_dir: Path) -> None:
    allowed = tmp_path / "imports"
    shutil.copytree(qwen_dir, allowed / "model")
    shutil.copy(tinycoder_gguf, allowed / "coder.gguf")
    (allowed / "model" / "README.md").symlink_to(allowed / "model" / "config.json")  # inside: allowed
    access = LocalAccess.under(allowed)
    one = store.pull("coder.gguf", access=access)
    assert one.manifest["layout"] == "file" and one.manifest["files"][0]["path"] == "model.gguf"
    assert store.blobs.path(one.manifest["files"][0]["digest"]).read_bytes() == tinycoder_gguf.read_bytes()
    folder = store.pull("model", name="folder", access=access)
    assert folder.manifest["layout"] == "dir" and {"README.md", "config.json"} <= \
        {f["path"] for f in folder.manifest["files"]}


def test_a_fifo_is_refused_without_a_hang(store: ModelStore, tmp_path: Path, qwen_dir: Path) -> None:
    import os
    import time

    allowed = tmp_path / "imports"
    shutil.copytree(qwen_dir, allowed / "model")
    os.mkfifo(allowed / "model" / "pipe.bin")
    start = time.monotonic()
    with pytest.raises(SourceError, match="pipe.bin: not a regular file"):
        store.pull("model", access=LocalAccess.under(allowed))
    assert time.monotonic() - start < 5


def test_a_file_swapped_for_a_link_during_imports_is_never_stored(store: ModelStore, tmp_path: Path,
                                                                  qwen_dir: Path) -> None:
    # before: each path was checked, then opened again: a swap in between stored (and let push publish) the secret
    import hashlib
    import os
    import threading

    secret = _secret(tmp_path)
    allowed = tmp_path / "imports"
    shutil.copytree(qwen_dir, allowed / "model")
    notes = allowed / "model" / "notes.txt"
    notes.write_text("harmless")
    stop = threading.Event()

    def swap() -> None:
        link, plain = allowed / ".link", allowed / ".plain"
        while not stop.is_set():
            link.unlink(missing_ok=True)
            link.symlink_to(secret)
            os.replace(link, notes)
            plain.write_text("harmless")
            os.replace(plain, notes)

    swapper = threading.Thread(target=swap)
    swapper.start()
    outcomes = []
    try:
        for i in range(30):
            try:
                store.pull("model", name=f"m{i}", access=LocalAccess.under(allowed))
                outcomes.append("stored")
            except SourceError as exc:
                assert "SECRET" not in str(exc)
                outcomes.append("refused")
    finally:
        stop.set()
        swapper.join()
    secret_digest = "sha256:" + hashlib.sha256(secret.read_bytes()).hexdigest()
    assert secret_digest not in store.blobs.digests(), outcomes
    assert len(outcomes) == 30
