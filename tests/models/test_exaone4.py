"""EXAONE 4, a family added as one module (runlm/models/families/exaone4.py): OLMo 2's layer with per-head q/k
norms, sliding-window layers with RoPE and a global one without (layer 3 of the 4-layer test model, window 16: the
200-token prompt crosses it). Exact mode within 1e-4 of transformers and its greedy tokens, from safetensors and
from llama.cpp's GGUF."""
from __future__ import annotations

import json

import pytest

from runlm.formats.gguf import GGUFFile
from runlm.models.config import ModelConfig
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.models.test_families import matches_transformers


def test_the_global_layers_take_no_rope_in_both_formats(tiny_model) -> None:
    hf = ModelConfig.from_hf(json.loads((tiny_model("exaone4") / "config.json").read_text()))
    gguf = ModelConfig.from_gguf(GGUFFile(converted_gguf("exaone4")))
    assert hf.family == gguf.family == "exaone4"
    assert hf.nope_layers == gguf.nope_layers == [3]
    assert [hf.layer_window(i) for i in range(4)] == [gguf.layer_window(i) for i in range(4)] == [16, 16, 16, None]


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_exaone4_matches_transformers(fmt: str, tiny_model) -> None:
    cfg = matches_transformers("exaone4", fmt, tiny_model).config
    assert cfg.qk_norm and not cfg.qk_norm_whole
