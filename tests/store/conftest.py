from __future__ import annotations

from pathlib import Path
from typing import Iterator

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
