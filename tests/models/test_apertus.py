"""Apertus, a family added as one module (runlm/models/families/apertus.py): per-head q/k norms and an ungated MLP whose
xIELU activation has parameters learned per layer (random and different per layer in the test model). Exact mode
within 1e-4 of transformers and its greedy tokens, from safetensors (the parameters as tensors) and from llama.cpp's
converter's GGUF (the parameters as ``xielu.*`` metadata); fast mode held to llama.cpp's KL on the same Q8_0 file."""
from __future__ import annotations

import pytest

from runlm.kernels import ggml
from tests.fixtures.default_run import default_run
from tests.models.test_families import fast_mode_kl, matches_transformers

# llama.cpp (llama-cpp-python 0.3.36, logits_all, one 512-token context) on the converter's Q8_0 file against exact
# mode on its f32 file, first 512 tokens of english_text(): 0.00221 (its f32 logits: 4e-7); runlm 0.00222
LLAMA_CPP_Q8_0_KL = 0.00221


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_apertus_matches_transformers(fmt: str, tiny_model) -> None:
    loaded = matches_transformers("apertus", fmt, tiny_model)
    acts = [layer.mlp.act for layer in loaded.model.model.layers]
    assert loaded.config.family == "apertus" and acts[0].alpha_p.item() != acts[1].alpha_p.item()


@pytest.mark.skipif(not ggml.available(), reason="ggml's kernels are unavailable: fast mode is exact mode here")
def test_fast_mode_kl_divergence_is_llama_cpps() -> None:
    kl = fast_mode_kl("apertus")
    assert 0 < kl < 1.25 * LLAMA_CPP_Q8_0_KL, f"fast mode's KL divergence {kl:.6f}"
