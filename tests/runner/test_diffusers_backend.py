"""The diffusers backend's protocol: status, install, memory from the pipeline's weights, its command line."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from runlm.runner.backends import all_backends
from runlm.runner.backends.base import BackendError
from runlm.runner.backends.diffusers import ACTIVATION_SHARE, RUNTIME_OVERHEAD
from runlm.runner.config import BackendConfig, BackendMode, ConfigError
from runlm.store import ModelStore


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory, tiny_sd: Path):
    return ModelStore(tmp_path_factory.mktemp("home")).pull(str(tiny_sd), "tiny-sd")


def test_status_follows_whether_diffusers_is_importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = all_backends(tmp_path)["diffusers"]
    assert backend.status().startswith("Running: diffusers ") and backend.disk_usage() > 0
    monkeypatch.setitem(sys.modules, "diffusers", None)  # what find_spec sees when it is not installed
    assert backend.status() == "Not Installed: diffusers not installed; run: runlm install-backend diffusers"
    assert not backend.installed()
    with pytest.raises(BackendError, match="Not Installed"):
        asyncio.run(backend.run("/tmp/x.sock", "/m", "m", BackendMode.IMAGE_GENERATION, BackendConfig()))


def test_memory_comes_from_the_pipelines_weights(stored, tmp_path: Path) -> None:
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(stored.manifest["source"]["location"])
    params = sum(p.numel() for c in pipe.components.values() if isinstance(c, torch.nn.Module) for p in c.parameters())
    assert stored.info.parameters == params  # read from the safetensors headers at pull time, no weights loaded
    backend = all_backends(tmp_path)["diffusers"]
    cpu = backend.required_memory(stored, BackendConfig())
    assert cpu.ram == int(params * 4 * (1 + ACTIVATION_SHARE)) + RUNTIME_OVERHEAD and cpu.vram == 0
    gpu = backend.required_memory(stored, BackendConfig(runtime_flags=["--device", "cuda"]))
    assert gpu.ram == RUNTIME_OVERHEAD and gpu.vram == int(params * 2 * (1 + ACTIVATION_SHARE))  # float16


def test_command_line_and_settings(tmp_path: Path) -> None:
    backend = all_backends(tmp_path)["diffusers"]
    argv = backend.command("/s.sock", "/pipe", "tiny-sd:latest", BackendConfig(runtime_flags=["--threads", "1"]))
    assert argv[1:4] == ["-m", "runlm.image_generation.serve", "/pipe"] and argv[-2:] == ["--threads", "1"]
    assert argv[argv.index("--uds") + 1] == "/s.sock" and argv[argv.index("--served-model-name") + 1] == "tiny-sd:latest"
    with pytest.raises(ConfigError, match="not allowed"):
        backend.check_config(BackendConfig(runtime_flags=["--api-key", "k"]))
    with pytest.raises(ConfigError, match="no context"):
        backend.check_config(BackendConfig(context_size=4096))
    with pytest.raises(ConfigError, match="draft model"):
        backend.check_config(BackendConfig.from_json({"speculative": {"draft_model": "x"}}))
    assert backend.modes == (BackendMode.IMAGE_GENERATION,)
    with pytest.raises(BackendError, match="cannot serve completion"):
        asyncio.run(backend.run("/tmp/x.sock", "/m", "m", BackendMode.COMPLETION, BackendConfig()))
