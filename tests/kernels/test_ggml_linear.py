"""runlm.kernels.ggml: linear layers and lookups on GGUF block types through ggml's dot products."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from runlm.kernels import ggml

pytestmark = pytest.mark.skipif(not ggml.available(), reason="libggml-python or a compiler is missing here")

# every type the fast path promises (issue 11), with how far a dequantized weight may stray (relative)
TYPES = {T.F16: 1e-3, T.BF16: 1e-2, T.Q8_0: 1e-2, T.Q5_0: 0.05, T.Q5_1: 0.05, T.Q4_0: 0.1, T.Q4_1: 0.1,
         T.IQ4_NL: 0.1, T.IQ4_XS: 0.1, T.Q6_K: 0.03, T.Q5_K: 0.05, T.Q4_K: 0.1, T.Q3_K: 0.2, T.Q2_K: 0.4}
K = 512  # a whole number of every block size (32 and 256)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(72, K, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda t: t.name)
def test_every_type_multiplies_as_its_dequantized_weights(qtype: T, weight: torch.Tensor) -> None:
    raw = ggml.quantize(weight, qtype)
    assert raw.shape == (72, ggml.row_bytes(qtype, K))
    dense = ggml.dequantize(raw, qtype, K)
    assert _rel(dense, weight) < TYPES[qtype]
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    y = ggml.linear(x, [raw], [qtype])
    # the only extra error is quantizing x to 8 bits (or to half precision for F16/BF16)
    assert _rel(y, x @ dense.T) < 0.02


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1, T.F16, T.BF16],
                         ids=lambda t: t.name)
def test_a_rows_result_never_depends_on_the_batch(qtype: T, weight: torch.Tensor) -> None:
    # 69 rows: the block kernels' panels of 8 end in a partial one; 40 x rows: a chunk of 32 and a rest
    raw = ggml.quantize(weight[:69], qtype)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(2))
    full = ggml.linear(x, [raw], [qtype])
    for m in (1, 7, 33):
        assert torch.equal(ggml.linear(x[:m], [raw], [qtype]), full[:m])
    assert torch.equal(ggml.linear(x[11], [raw], [qtype]), full[11])  # a 1-D row too
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ggml.linear(x, [raw], [qtype]), full)
    finally:
        torch.set_num_threads(before)


def test_segments_of_mixed_types_concatenate_their_outputs(weight: torch.Tensor) -> None:
    """q/k/v of a Q4_K_M file: Q4_K and Q6_K rows in one call, x quantized once per activation type."""
    parts = [(weight[:32], T.Q4_K), (weight[32:48], T.Q6_K), (weight[48:], T.Q8_0)]
    raws = [ggml.quantize(w, t) for w, t in parts]
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(72)
    y = ggml.linear(x, raws, [t for _, t in parts], bias)
    alone = torch.cat([ggml.linear(x, [r], [t]) for r, (_, t) in zip(raws, parts)], dim=-1) + bias
    assert torch.equal(y, alone)


def test_embedding_gathers_dequantized_rows(weight: torch.Tensor) -> None:
    raw = ggml.quantize(weight, T.Q6_K)
    ids = torch.tensor([[5, 0], [71, 5]])
    rows = ggml.embedding(ids, raw, T.Q6_K, K)
    assert rows.shape == (2, 2, K)
    assert torch.equal(rows, ggml.dequantize(raw, T.Q6_K, K)[ids])
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        ggml.embedding(torch.tensor([72]), raw, T.Q6_K, K)


def test_bad_shapes_are_refused_with_a_reason(weight: torch.Tensor) -> None:
    raw = ggml.quantize(weight, T.Q4_K)
    with pytest.raises(RuntimeError, match="needs"):
        ggml.linear(torch.randn(1, K - 256), [raw], [T.Q4_K])
    with pytest.raises(RuntimeError, match="whole number"):
        ggml.quantize(torch.randn(4, 100), T.Q4_K)
