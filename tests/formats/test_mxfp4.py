"""MXFP4 (gpt-oss's expert weights, as llama.cpp stores them): a GGUF tensor of that type dequantizes to gguf-py's
reference values in exact mode, and fast mode's ggml dot products on the stored blocks give the same products."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from runlm.formats.gguf import GGUFFile, ggml_type
from runlm.kernels import ggml


@pytest.fixture(scope="module")
def mxfp4_file(tmp_path_factory) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((64, 256)).astype(np.float32)
    blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.MXFP4)
    path = tmp_path_factory.mktemp("mxfp4") / "experts.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_gate_exps.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)


def test_mxfp4_dequantizes_as_the_reference(mxfp4_file) -> None:
    path, reference = mxfp4_file
    f = GGUFFile(path)
    info = f.tensors["blk.0.ffn_gate_exps.weight"]
    assert info.qtype == "MXFP4" and info.n_bytes == 64 * 256 // 32 * 17
    np.testing.assert_array_equal(f.load_array("blk.0.ffn_gate_exps.weight"), reference)


@pytest.mark.skipif(not ggml.available(), reason="ggml's kernels are unavailable")
def test_fast_mode_computes_on_the_stored_blocks(mxfp4_file) -> None:
    path, reference = mxfp4_file
    f = GGUFFile(path)
    assert ggml.supported(ggml_type("MXFP4"))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    out = ggml.linear(x, [f.raw_tensor("blk.0.ffn_gate_exps.weight")], [ggml_type("MXFP4")])
    exact = x @ torch.from_numpy(reference).T
    assert (out - exact).abs().max() / exact.abs().max() < 0.02  # (8-bit activations, as llama.cpp's)
