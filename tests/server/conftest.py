from __future__ import annotations

import pytest

from tests.server.process import ServerProcess

API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def smollm2_server():
    """smollm2 behind a real serve-engine process on a free loopback port, with an API key."""
    server = ServerProcess("smollm2", ["--kv-cache-memory", "256MiB", "--api-key", API_KEY,
                                       "--served-model-name", "smollm2", "smollm2:latest"]).start()
    yield server
    server.stop()
