"""Weights straight to the device (runlm.models.gpu_load), checked on the CPU: the torch dequantizers equal
gguf-py's, and the loaded parameters equal today's loader's."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from runlm.models.gpu_load import DEVICE_QUANTS, dequantize_on_device, load_to_device
from runlm.models.load import load_decoder


def _random_blocks(qtype: str, n_blocks: int, seed: int) -> np.ndarray:
    """Random ggml blocks of ``qtype`` whose fp16 scales are finite and modest."""
    per_block, nbytes, _ = DEVICE_QUANTS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    scale = lambda: rng.uniform(-0.05, 0.05, n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)  # noqa
    if qtype in ("Q8_0", "Q4_0"):
        raw[:, 0:2] = scale()
    elif qtype in ("Q4_K", "Q5_K"):
        raw[:, 0:2], raw[:, 2:4] = scale(), scale()
    else:  # Q6_K: d last
        raw[:, 208:210] = scale()
    return raw


@pytest.mark.parametrize("qtype", sorted(DEVICE_QUANTS))
def test_torch_dequantizers_equal_gguf_py(qtype: str) -> None:
    per_block = DEVICE_QUANTS[qtype][0]
    raw = _random_blocks(qtype, 24, seed=len(qtype))
    shape = (4, 6 * per_block)
    want = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType[qtype]).reshape(shape)
    got = dequantize_on_device(torch.from_numpy(raw.reshape(-1).copy()), qtype, shape)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-8)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["qwen2", "llama-tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_weights_equal_todays_loader(tiny_model, recipe: str, dtype: torch.dtype) -> None:
    path = tiny_model(recipe)
    want = _params(load_decoder(path, dtype=dtype, exact_numerics=True).model)
    got = _params(load_to_device(path, dtype=dtype, device="cpu").model)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == dtype
        assert torch.equal(got[name], want[name]), name


def test_gguf_weights_dequantized_on_the_device_equal_todays_loader(caplog) -> None:
    from tests.fixtures.gguf_convert import converted_gguf

    path = converted_gguf("llama", "q8_0")
    want = _params(load_decoder(path, dtype=torch.bfloat16).model)  # dense: dequantized on the host
    with caplog.at_level("INFO", logger="runlm.gpu"):
        got = _params(load_to_device(path, dtype=torch.bfloat16, device="cpu").model)
    assert "dequantized on cpu to bfloat16" in caplog.text and "MiB as stored" in caplog.text
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_block_type_without_a_device_dequantizer_is_dequantized_on_the_host(smollm2_gguf) -> None:
    """SmolLM2's Q4_1 matrices: the host's dequantizer, then the device; the same tensors."""
    want = _params(load_decoder(smollm2_gguf, dtype=torch.bfloat16).model)
    got = _params(load_to_device(smollm2_gguf, dtype=torch.bfloat16, device="cpu").model)
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(got[name], want[name]), name
