"""Phi-2, a family added as one module (runlm/models/families/phi.py): StableLM's parallel LayerNorm layer with an
ungated GELU MLP, biases everywhere (random in the test model, norms too) and RoPE on half of each head. Exact mode
within 1e-4 of transformers and its greedy tokens, from safetensors (its own tensor names) and from llama.cpp's phi2
GGUF."""
from __future__ import annotations

import pytest

from runlm.models.llama import UngatedMLP
from tests.fixtures.default_run import default_run
from tests.models.test_families import matches_transformers


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_phi_matches_transformers(fmt: str, tiny_model) -> None:
    loaded = matches_transformers("phi", fmt, tiny_model)
    cfg = loaded.config
    assert cfg.family == "phi" and cfg.parallel_residual and cfg.rotary_dim == cfg.head_dim // 2
    mlp = loaded.model.model.layers[0].mlp
    assert isinstance(mlp, UngatedMLP) and mlp.up_proj.bias is not None
    assert loaded.model.lm_head is not None and loaded.model.lm_head.bias is not None
