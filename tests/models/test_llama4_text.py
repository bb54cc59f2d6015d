"""Llama 4's text decoder, a family added as one module (runlm/models/families/llama4_text.py): chunked local attention,
global no-RoPE layers with temperature-tuned queries, weightless q/k norms after RoPE, experts routed by a sigmoid that
scales their inputs beside a shared expert. Exact mode within 1e-4 of transformers and its greedy tokens from
safetensors with small constants (chunks of 16, floor_scale 4: every piece acts within the prompt), and from
llama.cpp's converter's ``llama4`` GGUF, whose constants are llama.cpp's fixed ones (a model with Llama 4's own);
fast mode held to llama.cpp's KL on the same Q8_0 file."""
from __future__ import annotations

import pytest

from runlm.kernels import ggml
from tests.models.test_families import fast_mode_kl, matches_transformers

# llama.cpp (llama-cpp-python 0.3.36, logits_all, one 512-token context) on the converter's Q8_0 file against exact
# mode on its f32 file, first 512 tokens of english_text(): 0.0619 (its f32 logits: 3e-6); runlm 0.0673
LLAMA_CPP_Q8_0_KL = 0.0619


def test_llama4_text_matches_transformers(tiny_model) -> None:
    cfg = matches_transformers("llama4-text", "safetensors", tiny_model).config
    assert cfg.family == "llama4_text" and cfg.attention_chunk == 16 and cfg.nope_layers == [3]
    assert cfg.dense_layers == [0, 2] and cfg.moe_weight_input and cfg.attn_floor_scale == 4.0


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_llama4_texts_own_constants_match_transformers_from_both_formats(fmt: str, tiny_model) -> None:
    cfg = matches_transformers("llama4-text-8192", fmt, tiny_model).config
    assert cfg.attention_chunk == 8192 and cfg.attn_floor_scale == 8192.0 and cfg.qk_l2_norm
    assert cfg.layer_types == ["chunked_attention"] * 3 + ["full_attention"]


@pytest.mark.skipif(not ggml.available(), reason="ggml's kernels are unavailable: fast mode is exact mode here")
def test_fast_mode_kl_divergence_is_llama_cpps() -> None:
    kl = fast_mode_kl("llama4-text-8192")
    assert 0 < kl < 1.25 * LLAMA_CPP_Q8_0_KL, f"fast mode's KL divergence {kl:.6f}"
