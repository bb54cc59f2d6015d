from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runlm.store import ModelStore
from tests.runner.daemon import Daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon for a test file's API tests, with tinycoder in its store (one per file: what a file's tests leave
    behind -- a tag, a loaded model -- never reaches another file, whichever order the workers run them in)."""
    home = tmp_path_factory.mktemp("runlm-home")
    ModelStore(home).pull("tinycoder")
    d = Daemon(home).start()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def qwen2_dir(tiny_model) -> Path:
    return tiny_model("qwen2")
