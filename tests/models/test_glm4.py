"""GLM-4, a family added as one module (runlm/models/families/glm4.py): sandwich norms, q/k/v biases (random in the
test model, norms too), a fused gate_up matrix and RoPE on feature pairs over half of each head. Exact mode within
1e-4 of transformers and its greedy tokens, from safetensors and from llama.cpp's glm4 GGUF (the model rotating
pairs for both)."""
from __future__ import annotations

import pytest

from tests.fixtures.default_run import default_run
from tests.models.test_families import matches_transformers


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_glm4_matches_transformers(fmt: str, tiny_model) -> None:
    loaded = matches_transformers("glm4", fmt, tiny_model)
    cfg = loaded.config
    assert cfg.family == "glm4" and cfg.rotary_dim == cfg.head_dim // 2 and cfg.attention_bias
    assert loaded.model.model.rope.interleaved
