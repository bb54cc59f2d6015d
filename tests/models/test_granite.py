"""Granite 3, a family added as one module (runlm/models/families/granite.py): Llama's layer with embedding, residual,
attention and logit multipliers (the test model's far from 1: 6, 0.4, 0.1, 4). Exact mode within 1e-4 of transformers
and its greedy tokens, from safetensors and from llama.cpp's converter's GGUF (its ``granite.*_scale`` keys); the
multipliers read alike from both; fast mode on GGUF blocks, the runner choice naming why neither the native nor the
GPU runner builds it."""
from __future__ import annotations

import json

import pytest

from runlm.engine.llm import LLM
from runlm.formats.gguf import GGUFFile
from runlm.models.config import ModelConfig
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.models.test_families import matches_transformers


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_granite_matches_transformers(fmt: str, tiny_model) -> None:
    loaded = matches_transformers("granite", fmt, tiny_model)
    assert loaded.config.family == "granite"


def test_the_multipliers_read_alike_from_the_config_and_the_gguf_file(tiny_model) -> None:
    hf = ModelConfig.from_hf(json.loads((tiny_model("granite") / "config.json").read_text()))
    gguf = ModelConfig.from_gguf(GGUFFile(converted_gguf("granite")))
    for cfg in (hf, gguf):
        assert cfg.embed_scale == pytest.approx(6.0) and cfg.residual_scale == pytest.approx(0.4)
        assert cfg.logit_scale == pytest.approx(0.25) and cfg.query_pre_attn_scalar == pytest.approx(100.0, rel=1e-5)


def test_fast_mode_runs_on_the_torch_runner_and_says_why() -> None:
    llm = LLM(str(converted_gguf("granite", "q8_0")), max_model_len=256, kv_cache_memory="16MiB")
    assert llm.engine.choice.describe() == "torch (the granite family)"
    assert llm.generate(["The capital of France is"])[0].outputs[0].token_ids


def test_the_gpu_runner_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from runlm.engine.runners.select import select_runner
    from runlm.engine.types.config import EngineConfig
    from runlm.models.spec import read_spec

    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1")  # (its multipliers are the torch model's: tests/engine/test_gpu_runner)
    path = converted_gguf("granite", "q8_0")
    assert select_runner(read_spec(path), EngineConfig(model=str(path))).kind.name == "gpu"
