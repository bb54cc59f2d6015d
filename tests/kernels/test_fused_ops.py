"""runlm.kernels.fused: the fast path's per-layer small ops against torch's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runlm.kernels import fused

pytestmark = pytest.mark.skipif(not fused.available(), reason="the fused kernels cannot be built here")


def _rows(m: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("inner", [1536, 13])  # a multiple of the SIMD width, and one with a scalar tail
def test_silu_mul_is_torchs(inner: int) -> None:
    gate_up = _rows(5, 2 * inner, 0)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -88.5])  # far outside exp's float range, and 0
    ours = fused.ops().silu_mul(gate_up)
    theirs = F.silu(gate_up[:, :inner]) * gate_up[:, inner:]
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    # a row's result never depends on the other rows
    assert torch.equal(fused.ops().silu_mul(gate_up[3:4]), ours[3:4])


def test_rms_norms_are_torchs() -> None:
    x, residual, w = _rows(6, 576, 1), _rows(6, 576, 2), _rows(1, 576, 3)[0]
    expect = F.rms_norm(x, (576,), w, 1e-5)
    torch.testing.assert_close(fused.ops().rms_norm(x, w, 1e-5), expect, rtol=1e-5, atol=1e-5)
    summed = residual + x
    out = fused.ops().add_rms_norm(x, residual, w, 1e-5)
    torch.testing.assert_close(residual, summed)  # the residual stream is updated in place
    torch.testing.assert_close(out, F.rms_norm(summed, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
