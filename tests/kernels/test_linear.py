"""runlm.kernels.linear: accuracy, batch invariance (bitwise), odd shapes, fallbacks."""
from __future__ import annotations

import importlib
import logging
import math

import pytest
import torch
import torch.nn.functional as F

from runlm import kernels

linear_mod = importlib.import_module("runlm.kernels.linear")  # the module; the package exports the function
build_mod = importlib.import_module("runlm.kernels.build")


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    # Compiles on the first run (about 20 s), then loads from the torch extensions cache.
    if not kernels.available():
        pytest.skip("runlm linear kernel unavailable (CPU without AVX2/FMA, or no C++ compiler/ninja)")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield lambda n: torch.set_num_threads(n)
    torch.set_num_threads(before)


def _data(m: int, n: int, k: int, seed: int = 0, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def _check_accuracy(x, w, b):
    y = kernels.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    k = w.shape[1]
    assert y.dtype == torch.float32 and y.shape == ref.shape
    torch.testing.assert_close(y, ref.float(), rtol=1e-5, atol=1e-5 * math.sqrt(max(k, 1)))
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * math.sqrt(max(k, 1)))


@pytest.mark.parametrize("k", [1, 5, 7, 8, 9, 15, 16, 17, 24, 31, 33, 100, 896])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference_odd_k(k, bias):
    _check_accuracy(*_data(7, 13, k, seed=k, bias=bias))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 31, 32, 33, 600])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 9, 130])
def test_matches_reference_odd_m_n(m, n):
    _check_accuracy(*_data(m, n, 72, seed=m * 1000 + n, bias=n % 2 == 1))


def test_model_shapes():
    for n, k in [(1152, 896), (896, 4864), (576, 1536)]:
        for m in (1, 8, 37):
            _check_accuracy(*_data(m, n, k, seed=n + k + m, bias=True))


@pytest.mark.parametrize("k", [200, 896, 4864])
def test_batch_invariance_bitwise(k, threads):
    """Any slice of the batch, any row order, any thread count: bitwise the same rows."""
    x, w, b = _data(64, 45, k, seed=k, bias=True)
    threads(2)
    full = kernels.linear(x, w, b)
    slices = [(0, 1), (5, 6), (63, 64), (0, 2), (1, 4), (3, 7), (2, 10), (7, 15), (10, 42), (0, 63), (1, 64)]
    slices += [(a, a + s) for s in (3, 4, 5, 6, 8, 13) for a in range(0, 64 - s, 11)]
    for n in (1, 2):
        threads(n)
        assert torch.equal(kernels.linear(x, w, b), full), f"threads={n}"
        for a, e in slices:
            assert torch.equal(kernels.linear(x[a:e], w, b), full[a:e]), f"rows {a}:{e}, threads={n}"
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kernels.linear(x[perm], w, b), full[perm])
    # a row among other rows of a much larger batch (several M-chunks in the kernel)
    big = torch.randn(600, k, generator=torch.Generator().manual_seed(2))
    big[517] = x[5]
    assert torch.equal(kernels.linear(big, w, b)[517], full[5])


@pytest.mark.parametrize("m", [1, 2, 7])
def test_thread_split_invariance(m, threads):
    """Large N: the N range is split over threads even for one row; results must not move."""
    x, w, b = _data(9, 1003, 203, seed=m, bias=True)
    threads(1)
    ref = kernels.linear(x, w, b)
    threads(2)
    assert torch.equal(kernels.linear(x, w, b), ref)
    assert torch.equal(kernels.linear(x[:m], w, b), ref[:m])
    assert torch.equal(kernels.linear(x[-m:], w, b), ref[-m:])


def test_deterministic_across_calls():
    x, w, b = _data(33, 70, 300, bias=True)
    y = kernels.linear(x, w, b)
    for _ in range(3):
        assert torch.equal(kernels.linear(x, w, b), y)


def test_leading_dims_and_noncontiguous():
    x, w, b = _data(24, 17, 40, bias=True)
    flat = kernels.linear(x, w, b)
    y = kernels.linear(x.reshape(2, 3, 4, 40), w, b)
    assert y.shape == (2, 3, 4, 17)
    assert torch.equal(y.reshape(24, 17), flat)
    assert kernels.linear(x[0], w, b).shape == (17,)
    assert torch.equal(kernels.linear(x[0], w, b), flat[0])
    xt = x.t().contiguous().t()  # same values, column-major storage
    assert torch.equal(kernels.linear(xt, w, b), flat)
    wt = w.t().contiguous().t()
    assert torch.equal(kernels.linear(x, wt, b), flat)


def test_empty_and_zero_k():
    _, w, b = _data(1, 6, 10, bias=True)
    assert kernels.linear(torch.empty(0, 10), w, b).shape == (0, 6)
    x0, w0 = torch.empty(3, 0), torch.empty(6, 0)
    assert torch.equal(kernels.linear(x0, w0), torch.zeros(3, 6))
    assert torch.equal(kernels.linear(x0, w0, b), b.expand(3, 6))


def test_shape_mismatch_raises():
    x, w, _ = _data(2, 3, 8)
    with pytest.raises(RuntimeError):
        kernels.linear(x[:, :7], w)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_fallback_other_dtypes(dtype):
    x, w, b = (t.to(dtype) for t in _data(3, 5, 16, bias=True))
    y = kernels.linear(x, w, b)
    assert y.dtype == dtype
    assert torch.equal(y, F.linear(x, w, b))


def test_fallback_autograd():
    x, w, b = _data(3, 5, 16, bias=True)
    w.requires_grad_(True)
    y = kernels.linear(x, w, b)
    y.sum().backward()
    assert w.grad is not None
    torch.testing.assert_close(w.grad, x.sum(0).expand(5, 16))
    with torch.no_grad():  # no grad needed: the kernel path, still close to MKL
        torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b))


def test_build_failure_falls_back(monkeypatch, caplog):
    """A failed compile must log one warning, make available() False and route to F.linear."""
    import torch.utils.cpp_extension as cpp

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'runlm_linear_v2'\nno compiler")

    monkeypatch.setattr(cpp, "load", broken)
    monkeypatch.setattr(build_mod, "_import_built", lambda name: None)  # no earlier build to fall back on
    monkeypatch.setattr(build_mod, "_loaded", {})
    monkeypatch.setattr(linear_mod, "_kernel", build_mod.LazyKernel("runlm_linear", "linear.cpp"))
    with caplog.at_level(logging.WARNING, logger="runlm.kernels.build"):
        assert kernels.available() is False
        assert kernels.available() is False  # cached: no second attempt, no second warning
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    x, w, b = _data(3, 5, 16, bias=True)
    assert torch.equal(kernels.linear(x, w, b), F.linear(x, w, b))


def test_cpu_without_avx2_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(build_mod, "cpu_has_avx2_fma", lambda: False)
    monkeypatch.setattr(build_mod, "_loaded", {})
    monkeypatch.setattr(linear_mod, "_kernel", build_mod.LazyKernel("runlm_linear", "linear.cpp"))
    with caplog.at_level(logging.WARNING, logger="runlm.kernels.build"):
        assert kernels.available() is False
    assert not caplog.records  # an old CPU is not a problem worth a warning
    x, w, _ = _data(2, 3, 8)
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("m,n,k", [(1, 4, 32), (3, 7, 64), (4, 13, 96), (1, 1536, 576), (37, 576, 1536)])
def test_q8_is_bitwise_the_fp32_kernel_on_dequantized_weights(m, n, k):
    from runlm.kernels.linear import dequantize_blocks

    g = torch.Generator().manual_seed(m * n + k)
    q = torch.randint(-16, 16, (n, k), dtype=torch.int8, generator=g)
    d, off = torch.rand(n, k // 32, generator=g), torch.randn(n, k // 32, generator=g)
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    w = dequantize_blocks(q, d, off)
    assert torch.equal(kernels.linear_q8(x, q, d, off, bias), kernels.linear(x, w, bias))
    # a row alone gives the same bits as inside the batch
    assert torch.equal(kernels.linear_q8(x[-1:], q, d, off, bias)[0], kernels.linear_q8(x, q, d, off, bias)[-1])


def test_q8_rejects_bad_shapes():
    q = torch.zeros(4, 40, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.linear_q8(torch.randn(1, 40), q, torch.ones(4, 1), torch.zeros(4, 1))
