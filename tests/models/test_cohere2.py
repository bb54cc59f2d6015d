"""Cohere 2, a family added as one module (runlm/models/families/cohere2.py): a parallel layer with bias-free
LayerNorms (random in the test model), RoPE on feature pairs on the sliding-window layers only (three of four, a
16-token window under a 200-token prompt), scaled logits. Exact mode within 1e-4 of transformers and its greedy
tokens, from safetensors and from llama.cpp's cohere2 GGUF (no layer pattern in the file: the family's own)."""
from __future__ import annotations

import pytest

from tests.fixtures.default_run import default_run
from tests.models.test_families import matches_transformers


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_cohere2_matches_transformers(fmt: str, tiny_model) -> None:
    loaded = matches_transformers("cohere2", fmt, tiny_model)
    cfg = loaded.config
    assert cfg.family == "cohere2" and cfg.parallel_residual and not cfg.norm_bias
    assert cfg.nope_layers == [3] and cfg.logit_scale == pytest.approx(0.25) and cfg.sliding_window == 16
