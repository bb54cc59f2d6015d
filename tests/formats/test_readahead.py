"""runlm.formats.readahead: a loaded model's mapped files are read into the page cache on a thread of their own,
and never when they would not fit in the memory available."""
from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from runlm.formats import readahead

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_WILLNEED"), reason="no madvise here")


def _mapped(path: Path, size: int) -> np.ndarray:
    path.write_bytes(b"\1" * size)
    return np.memmap(path, mode="r").view(np.ndarray)[16:]  # a view of a view, as the loaders keep them


def test_mappings_are_read_ahead_on_a_thread_of_their_own(tmp_path: Path) -> None:
    views = [_mapped(tmp_path / "a.gguf", 1 << 20), _mapped(tmp_path / "b.safetensors", 1 << 16)]
    assert all(readahead.mapping_of(v) is not None for v in views)
    thread = readahead.read_ahead(views)
    assert thread is not None and thread.daemon and thread.name == "runlm-read-ahead"
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_mappings_larger_than_the_share_of_available_memory_are_left_alone(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    view = _mapped(tmp_path / "big.gguf", 4096)
    available = readahead.available_memory()
    assert available > 0
    monkeypatch.setattr(readahead, "SHARE_OF_AVAILABLE", 4096 / available / 2)  # half the file's size fits
    assert readahead.read_ahead([view]) is None


def test_arrays_in_memory_have_no_mapping_to_read() -> None:
    assert readahead.mapping_of(np.zeros(8, np.uint8)) is None
    assert readahead.read_ahead([np.zeros(8, np.uint8)]) is None
