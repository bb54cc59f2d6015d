"""gpt-oss, a family added as one module (runlm/models/families/gpt_oss.py, runlm/models/stacked_moe.py): attention sinks (random
in the test model), sliding layers alternating with global ones, q/k/v/o biases, untruncated YaRN, and experts in every
layer with biases (random), a router with a bias, the clamped SwiGLU. Exact mode within 1e-4 of transformers and its
greedy tokens, from safetensors (experts stacked, gate and up interleaved) and from llama.cpp's converter's GGUF (read
with the model's own YaRN); fast mode held to llama.cpp's KL on the same Q8_0 file."""
from __future__ import annotations

import pytest

from runlm.kernels import ggml
from runlm.models.load import load_decoder
from tests.fixtures.gguf_convert import converted_gguf
from tests.models.test_families import fast_mode_kl, matches_transformers

# Mean KL on the converter's Q8_0 file against exact mode on its f32 file, first 512 tokens of english_text().
# llama.cpp (llama-cpp-python 0.3.36, logits_all, one context): 0.448, of which its truncated YaRN alone (its f32 file)
# is 0.180; runlm 0.398 (AMD EPYC, AVX-512). Random routers choosing 4 of 8 experts flip under any rounding.
LLAMA_CPP_Q8_0_KL = 0.448


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_gpt_oss_matches_transformers(fmt: str, tiny_model) -> None:
    loaded = matches_transformers("gpt-oss", fmt, tiny_model)
    cfg = loaded.config
    assert cfg.family == "gpt_oss" and cfg.attention_sinks and cfg.swiglu_limit == 7.0
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2 and cfg.sliding_window == 16
    assert cfg.rope_scaling is not None and cfg.rope_scaling["truncate"] is False


@pytest.mark.skipif(not ggml.available(), reason="ggml's kernels are unavailable: fast mode is exact mode here")
def test_fast_mode_kl_divergence_is_llama_cpps() -> None:
    fast = load_decoder(converted_gguf("gpt-oss", "q8_0"))
    experts = fast.model.model.layers[0].mlp.experts
    assert all(e.gate_up_proj.ggml and e.gate_up_proj.weight is None for e in experts)  # the file's blocks
    kl = fast_mode_kl("gpt-oss", fast)
    assert 0 < kl < LLAMA_CPP_Q8_0_KL, f"fast mode's KL divergence {kl:.6f}"


def test_mxfp4_checkpoints_read_as_transformers_dequantizes_them_and_compute_on_the_blocks() -> None:
    """gpt-oss's Hugging Face checkpoints keep the experts in MXFP4: exact mode computes on their values (as
    transformers' own dequantizer gives them), within 1e-4 of transformers on those values, with its greedy tokens; fast
    mode keeps them as ggml MXFP4 blocks, as stored."""
    import torch
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from runlm.models.prequantized import Mxfp4Stack
    from tests.fixtures.models import mxfp4_gpt_oss
    from tests.models.test_families import _reference
    from tests.models.test_llama import _check, _prompt

    path, reference = mxfp4_gpt_oss()
    stored = load_file(str(path / "model.safetensors"))
    blocks, scales = (stored[f"model.layers.0.mlp.experts.gate_up_proj_{k}"] for k in ("blocks", "scales"))
    ours = Mxfp4Stack(blocks, scales).dense()
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    loaded = load_decoder(path, exact_numerics=True)
    _check(loaded, _reference(reference), _prompt(loaded.config.vocab_size, 200))
    if ggml.available():
        expert = load_decoder(path).model.model.layers[0].mlp.experts[0]
        assert expert.gate_up_proj.weight is None and [g.qtype for g in expert.gate_up_proj.ggml] == [39, 39]
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
        exact = loaded.model.model.layers[0].mlp.experts[0].gate_up_proj(x)
        assert (expert.gate_up_proj(x) - exact).abs().max() / exact.abs().max() < 0.02  # (8-bit activations)
