"""SmolLM3, the family added as one module (runlm/models/families/smollm3.py): Llama with no RoPE on every 4th
layer (NoPE; layer 3 of the 4-layer test model). Checked as tests/models/test_families.py checks the others:
exact mode's logits within 1e-4 relative of transformers' and 64 greedy tokens through the engine equal to
transformers' greedy, from safetensors and from the GGUF file llama.cpp's own converter writes (whose graph
skips RoPE on every 4th layer). The native runner on that file: tests/native/test_native_families.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from runlm.formats.gguf import GGUFFile
from runlm.models.config import ModelConfig
from runlm.models.load import load_decoder
from runlm.models.rope import RotaryEmbedding
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.models.test_families import _reference
from tests.models.test_llama import RTOL, _check, _our_logits, _prompt


def test_the_nope_layers_are_read_from_the_config_and_from_the_gguf_file(tiny_model) -> None:
    path = tiny_model("smollm3")
    hf = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    gguf = ModelConfig.from_gguf(GGUFFile(converted_gguf("smollm3")))
    assert hf.family == gguf.family == "smollm3"
    assert hf.nope_layers == gguf.nope_layers == [3]
    assert hf.layer_types is None and hf.sliding_window is None


def test_a_nope_layers_rotation_is_the_identity() -> None:
    rope = RotaryEmbedding.identity(16, 64)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    rq, rk = rope(torch.arange(5) * 7, q, k)
    assert torch.equal(rq, q) and torch.equal(rk, k)


def test_safetensors_match_transformers(tiny_model) -> None:
    path = tiny_model("smollm3")
    loaded = load_decoder(path, exact_numerics=True)
    assert loaded.config.family == "smollm3"
    _check(loaded, _reference(path), _prompt(loaded.config.vocab_size, 200))


def test_gguf_from_llama_cpps_converter_matches_transformers(tiny_model) -> None:
    loaded = load_decoder(converted_gguf("smollm3"), exact_numerics=True)
    assert loaded.config.family == "smollm3"
    _check(loaded, _reference(tiny_model("smollm3")), _prompt(loaded.config.vocab_size, 200))


def test_rotating_every_layer_would_not_match(tiny_model, tmp_path: Path) -> None:
    """The parity above depends on the NoPE layer: the same weights with RoPE on every layer are far off."""
    source = tiny_model("smollm3")
    shutil.copytree(source, tmp_path / "all-rope")
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "all-rope" / "config.json").write_text(json.dumps({**config, "no_rope_layers": [1, 1, 1, 1]}))
    loaded = load_decoder(tmp_path / "all-rope", exact_numerics=True)
    assert loaded.config.nope_layers == []
    ids = _prompt(loaded.config.vocab_size, 200)
    with torch.inference_mode():
        theirs = _reference(source)(torch.tensor([ids])).logits[0]
    rel = ((_our_logits(loaded, ids) - theirs).abs().max() / theirs.abs().max()).item()
    assert rel > 100 * RTOL


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_the_gpu_runner_gives_the_torch_runners_tokens(fmt: str, tiny_model, monkeypatch) -> None:
    """The GPU runner's host path (RUNLM_GPU_RUNNER=1 on the CPU: eager, as tests/engine/test_gpu_runner.py runs it);
    from GGUF its Q/K rows are un-interleaved on load, the NoPE layer's identity tables fit either layout."""
    from tests.engine.conftest import prompt_ids
    from tests.engine.test_gpu_runner import GREEDY, _llm, _tokens

    path = tiny_model("smollm3") if fmt == "safetensors" else converted_gguf("smollm3", "q8_0")
    prompts = [{"prompt_token_ids": prompt_ids(7 + 9 * i, seed=30 + i)} for i in range(3)]
    gpu = _tokens(_llm(path, True, monkeypatch).generate(prompts, GREEDY))
    assert gpu == _tokens(_llm(path, False, monkeypatch).generate(prompts, GREEDY))
