"""Half-precision weights (BF16, F16: safetensors matrices as stored) through half_gemm.h: every output is the dot
product of the weight row with the activation row rounded to the weights' type, in fp32 (a K that is not a
multiple of 8 included), and a row's result never depends on the batch it is in."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from runlm.native import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")


def _half(a: np.ndarray, qtype: T) -> tuple[np.ndarray, np.ndarray]:
    """fp32 values as raw half rows, rounded to nearest even (ggml's conversion), and those values back in fp32."""
    if qtype == T.F16:
        h = a.astype(np.float16)
        return h.view(np.uint8), h.astype(np.float32)
    bits = a.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded.view(np.uint8), (rounded.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("qtype", [T.BF16, T.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [64, 101])
def test_outputs_are_the_rounded_rows_dot_products(qtype: T, k: int) -> None:
    rng = np.random.default_rng(k)
    n, m = 37, 11  # partial weight and activation tiles
    raw, w = _half(rng.standard_normal((n, k)).astype(np.float32), qtype)
    x = rng.standard_normal((m, k)).astype(np.float32)
    weights = kernels.LinearWeights([np.ascontiguousarray(raw)], [int(qtype)], k)
    y = kernels.linear(x, weights, np.empty((m, n), np.float32))
    expected = _half(x, qtype)[1].astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(y - expected).max() < 1e-5 * np.abs(expected).max()
    for rows in (slice(0, 1), slice(3, 6), slice(10, 11)):  # alone or in any batch: the same bits
        assert np.array_equal(kernels.linear(x[rows], weights, np.empty((rows.stop - rows.start, n), np.float32)),
                              y[rows])
