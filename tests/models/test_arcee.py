"""Arcee, a family added as one module (runlm/models/families/arcee.py): Llama's layer with an ungated ReLU² MLP
(ModelConfig.gated_mlp). Exact mode within 1e-4 of transformers and its greedy tokens, from safetensors and from
llama.cpp's GGUF (interleaved Q/K, as Llama's); fast mode on GGUF blocks op by op, the runner choice naming why the
native runner does not run it; the GPU runner's host path equal to the torch runner."""
from __future__ import annotations

import pytest

from runlm.engine.llm import LLM
from runlm.models.llama import UngatedMLP
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.models.test_families import matches_transformers


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_arcee_matches_transformers(fmt: str, tiny_model) -> None:
    loaded = matches_transformers("arcee", fmt, tiny_model)
    cfg = loaded.config
    assert cfg.family == "arcee" and not cfg.gated_mlp and cfg.hidden_act == "relu2"
    assert isinstance(loaded.model.model.layers[0].mlp, UngatedMLP)


def test_fast_mode_runs_on_the_torch_runner_and_says_why() -> None:
    llm = LLM(str(converted_gguf("arcee", "q8_0")), max_model_len=256, kv_cache_memory="16MiB")
    assert llm.engine.choice.describe() == "torch (the arcee family)"
    assert llm.generate(["The capital of France is"])[0].outputs[0].token_ids


def test_the_gpu_runner_gives_the_torch_runners_tokens(tiny_model, monkeypatch) -> None:
    from tests.engine.conftest import prompt_ids
    from tests.engine.test_gpu_runner import GREEDY, _llm, _tokens

    path = tiny_model("arcee")
    prompts = [{"prompt_token_ids": prompt_ids(7 + 9 * i, seed=50 + i)} for i in range(3)]
    gpu = _tokens(_llm(path, True, monkeypatch).generate(prompts, GREEDY))
    assert gpu == _tokens(_llm(path, False, monkeypatch).generate(prompts, GREEDY))
