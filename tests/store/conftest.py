from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runlm.store import ModelStore
from tests.fixtures import registry as registry_fixture
from tests.fixtures.registry import Registry
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


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A real registry (CNCF Distribution) with basic auth, on a loopback port."""
    if not registry_fixture.available():
        pytest.skip("docker-registry (Debian package, CNCF Distribution) is not installed: apt-get install "
                    "docker-registry")
    reg = Registry(tmp_path_factory.mktemp("registry")).start()
    yield reg
    reg.stop()
