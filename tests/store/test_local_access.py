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
