"""OLMo 3, a family added as one module (runlm/models/families/olmo3.py): OLMo 2's layer with sliding-window
attention on three layers of four (a 16-token window in the test model, so a 200-token prompt shows it). Exact mode
within 1e-4 of transformers and its greedy tokens, from safetensors and from llama.cpp's GGUF (written as olmo2's,
with the window and its per-layer pattern); the GPU runner refusing it (two KV cache sizes) by name."""
from __future__ import annotations

import json

import pytest

from runlm.formats.gguf import GGUFFile
from runlm.models.config import ModelConfig
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.models.test_families import matches_transformers

LOCAL_GLOBAL = ["sliding_attention"] * 3 + ["full_attention"]


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_olmo3_matches_transformers(fmt: str, tiny_model) -> None:
    loaded = matches_transformers("olmo3", fmt, tiny_model)
    assert loaded.config.layer_types == LOCAL_GLOBAL and loaded.config.sliding_window == 16


def test_the_layers_read_alike_from_the_config_and_the_gguf_file(tiny_model) -> None:
    hf = ModelConfig.from_hf(json.loads((tiny_model("olmo3") / "config.json").read_text()))
    gguf = ModelConfig.from_gguf(GGUFFile(converted_gguf("olmo3")))
    assert hf.family == "olmo3" and gguf.family == "olmo2"  # (llama.cpp's architecture for both)
    for cfg in (hf, gguf):
        assert cfg.layer_types == LOCAL_GLOBAL and cfg.qk_norm_whole and cfg.nope_layers == []
