"""Shared fixtures: real model files (built-in packages) and generated test models."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.fixtures import models
from tests.fixtures.default_run import mark_the_rest_slow

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# (under pytest-xdist the workers share the cores)
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


@pytest.hookimpl(tryfirst=True)  # (before -m 'not slow' deselects)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_the_rest_slow(config, items)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return models.smollm2_gguf()


@pytest.fixture(scope="session")
def tinycoder_gguf() -> Path:
    return models.tinycoder_gguf()


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return models.minilm_dir()


@pytest.fixture(scope="session")
def tiny_model():
    """tiny_model("qwen2") -> path of a cached random-weight model directory."""
    return models.build_model


@pytest.fixture(scope="session")
def tiny_sd() -> Path:
    """A random-weight Stable Diffusion pipeline directory (diffusers' own classes, a few thousand parameters)."""
    from tests.fixtures.diffusion import tiny_pipeline

    return tiny_pipeline()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory):
    """A real OCI registry (CNCF Distribution) with basic auth on a loopback port (tests/fixtures/registry.py)."""
    from tests.fixtures.registry import Registry, available

    if not available():
        pytest.skip("docker-registry (Debian's package of CNCF Distribution) is not installed: "
                    "apt-get install docker-registry")
    reg = Registry(tmp_path_factory.mktemp("registry")).start()
    yield reg
    reg.stop()
