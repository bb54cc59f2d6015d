"""Weights straight to the device (runlm.models.gpu_load), checked on the CPU: the torch dequantizers equal
gguf-py's, and the loaded parameters equal today's loader's."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from runlm.models.gpu_blocks import DEVICE_QUANTS, dense, dequantize_on_device
from runlm.models.gpu_load import load_to_device
from runlm.models.linear import Embedding, Linear
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
    """Every weight as a tensor: a layer kept in GGUF blocks as its blocks dequantized (then cast as the dense
    loader casts them)."""
    out = {n: p.detach() for n, p in model.named_parameters()}
    dtype = next(p for p in model.parameters()).dtype
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.device_blocks and name != "tied_head":
            out[f"{name}.weight"] = torch.cat([dense(s) for s in m.device_blocks]).to(dtype)
        if isinstance(m, Embedding) and m.device_blocks is not None:
            out[f"{name}.weight"] = dense(m.device_blocks).to(dtype)
    return out


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


@pytest.mark.parametrize("blocks", [False, True])
def test_gguf_weights_on_the_device_equal_todays_loader(caplog, blocks: bool) -> None:
    """Dequantized on the device, or kept in their blocks there (every matrix, the embedding's table too: Q/K rows
    turned back whole), the weights are the host loader's; the blocks take the file's bytes."""
    from tests.fixtures.gguf_convert import converted_gguf

    path = converted_gguf("llama", "q8_0")
    want = _params(load_decoder(path, dtype=torch.bfloat16).model)  # dense: dequantized on the host
    with caplog.at_level("INFO", logger="runlm.gpu"):
        model = load_to_device(path, dtype=torch.bfloat16, device="cpu", gguf_blocks=blocks).model
    got = _params(model)
    kept = [n for n, m in model.named_modules() if isinstance(m, Linear) and m.device_blocks]
    assert len(kept) == (4 * 2 + 1 if blocks else 0)  # (2 layers: qkv, o, gate_up, down; the LM head)
    assert "dequantized on cpu to bfloat16" in caplog.text and "MiB as stored" in caplog.text
    assert ("(1.0" if blocks else "x the file's") in caplog.text  # (the norms: a few KiB)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_block_type_without_a_device_dequantizer_is_dequantized_on_the_host(smollm2_gguf) -> None:
    """SmolLM2's Q4_1 matrices: the host's dequantizer, then the device; the same tensors."""
    want = _params(load_decoder(smollm2_gguf, dtype=torch.bfloat16).model)
    got = _params(load_to_device(smollm2_gguf, dtype=torch.bfloat16, device="cpu").model)
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(got[name], want[name]), name
