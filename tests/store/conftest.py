from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runlm.store import ModelStore
from tests.store.file_server import FileServer


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    return ModelStore(tmp_path / "home")


@pytest.fixture
def file_server() -> Iterator[tuple[FileServer, str]]:
    server = FileServer()
    url = server.start()
    yield server, url
    server.stop()
