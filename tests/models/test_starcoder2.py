"""StarCoder2, a family added as one module (runlm/models/families/starcoder2.py): StableLM's sequential LayerNorm
layer with an ungated GELU MLP and biases everywhere (random in the test model, norms too). Exact mode within 1e-4
of transformers and its greedy tokens, from safetensors (its c_fc/c_proj names) and from llama.cpp's GGUF."""
from __future__ import annotations

import pytest

from runlm.models.llama import UngatedMLP
from tests.fixtures.default_run import default_run
from tests.models.test_families import matches_transformers


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_starcoder2_matches_transformers(fmt: str, tiny_model) -> None:
    loaded = matches_transformers("starcoder2", fmt, tiny_model)
    cfg = loaded.config
    assert cfg.family == "starcoder2" and not cfg.parallel_residual and cfg.mlp_bias and cfg.attention_bias
    assert isinstance(loaded.model.model.layers[0].mlp, UngatedMLP)
