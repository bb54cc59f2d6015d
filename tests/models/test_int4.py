"""4-bit GPTQ and AWQ checkpoints (runlm/models/prequantized.py), made from the llama recipe by the packing AutoGPTQ's
and AutoAWQ's ``pack`` write (GPTQ with act-order and v1's stored-less-one zeros; AWQ's GEMM column order): exact
mode computes on scale * (q - zero), within 1e-4 of transformers on the same values dequantized, with its greedy
tokens; fast mode repacks each matrix once to Q8_0 blocks."""
from __future__ import annotations

import pytest

from runlm.kernels import ggml
from runlm.models.load import load_decoder
from tests.fixtures.models import int4_model
from tests.models.test_families import _reference
from tests.models.test_llama import _check, _prompt


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_matches_transformers_on_the_dequantized_values(method: str) -> None:
    path, reference = int4_model(method)
    loaded = load_decoder(path, exact_numerics=True)
    _check(loaded, _reference(reference), _prompt(loaded.config.vocab_size, 200))


@pytest.mark.skipif(not ggml.available(), reason="ggml's kernels are unavailable: fast mode is exact mode here")
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_fast_mode_repacks_them_to_q8_0(method: str) -> None:
    fast = load_decoder(int4_model(method)[0])
    proj = fast.model.model.layers[0].mlp.gate_up_proj
    assert proj.weight is None and [g.qtype for g in proj.ggml] == [8, 8]
