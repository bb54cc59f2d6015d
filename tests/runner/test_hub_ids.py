"""A Hugging Face repo id wherever a model is named (vLLM's ``serve org/name``, ``llama-server -hf org/name:QUANT``):
resolved through the local Hugging Face cache, offline here (a cache laid out as huggingface_hub lays it out, with
HF_HUB_OFFLINE=1): a safetensors repo is its snapshot folder, a repo of GGUF files the one its tag names (a split one
its first file, the others beside it); ``runlm run org/name`` stores it first, as ``ollama run`` pulls."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from runlm.catalog import UnknownModelError, resolve_model
from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from tests.fixtures.gguf_convert import converted_gguf, split_gguf
from tests.runner.daemon import runlm

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cached(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """``files`` as a snapshot of ``repo`` in a Hugging Face cache at ``cache``."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    for name, source in files.items():
        shutil.copy(source, snapshot / name)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, tiny_model, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf-cache"
    source = tiny_model("llama")
    _cached(cache, "test-org/tiny-llama", {p.name: p for p in source.iterdir() if p.is_file()})
    _cached(cache, "test-org/tiny-llama-GGUF", {"tiny-llama-F32.gguf": converted_gguf("llama"),
                                                 "tiny-llama-Q8_0.gguf": converted_gguf("llama", "q8_0")})
    shards = sorted(split_gguf("llama").parent.glob("*.gguf"))
    _cached(cache, "test-org/tiny-llama-split", {p.name: p for p in shards})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_repo_ids_resolve_through_the_local_cache(hub_cache: Path) -> None:
    snapshot = hub_cache / "models--test-org--tiny-llama" / "snapshots" / COMMIT
    assert resolve_model("test-org/tiny-llama") == snapshot
    assert resolve_model("test-org/tiny-llama-GGUF:Q8_0").name == "tiny-llama-Q8_0.gguf"
    assert resolve_model("hf.co/test-org/tiny-llama-GGUF:f32").name == "tiny-llama-F32.gguf"
    assert resolve_model("test-org/tiny-llama-split").name == "llama-00001-of-00003.gguf"
    with pytest.raises(UnknownModelError, match="not in the local cache and the hub cannot be reached"):
        resolve_model("test-org/absent")
    with pytest.raises(UnknownModelError, match="no GGUF file matching 'Q2_K'"):
        resolve_model("test-org/tiny-llama-GGUF:Q2_K")


def test_the_python_api_and_run_take_a_repo_id(hub_cache: Path, tmp_path: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = [LLM(ref, max_model_len=128, kv_cache_memory="8MiB").generate(["Hello"], params)[0].outputs[0].token_ids
            for ref in ("test-org/tiny-llama-GGUF:f32", "test-org/tiny-llama-split")]
    assert outs[0] == outs[1]  # (the same weights, one file and split)
    home = tmp_path / "home"
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    res = runlm(home, "run", "test-org/tiny-llama", "hi", "--max-tokens", "3", **env)
    assert res.returncode == 0 and res.stdout.strip(), res.stderr
    assert "storing the model test-org/tiny-llama" in res.stderr
    assert "test-org/tiny-llama" in runlm(home, "ls", **env).stdout
    again = runlm(home, "run", "test-org/tiny-llama", "hi", "--max-tokens", "3", **env)
    assert again.returncode == 0 and "storing" not in again.stderr  # found in the store by its id
