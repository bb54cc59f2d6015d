"""Pre-quantized checkpoints on the GPU runner (runlm/models/gpu_prequantized.py, runlm/kernels/triton/quant_matmul.py):
the device layout holds bit for bit the values the CPU runners read (runlm.models.prequantized) for GPTQ (act-order,
v1 and v2 zeros), AWQ and FP8 (per tensor, per row, per tile); the Triton kernel under the interpreter against
x @ dense^T for decode and prefill shapes, columns past a multiple of 32, a column slice of a wider output; compiled
for sm_90; and (slow) a GPTQ and an FP8 checkpoint end to end on the GPU runner against the torch runner's tokens.
As test_gpu_triton_attention.py, the interpreted tests run in a child pytest with TRITON_INTERPRET=1."""
from __future__ import annotations

import pytest
import torch

from runlm.kernels import triton as rtriton
from runlm.models import prequantized
from runlm.models.gpu_prequantized import DeviceQuantized, from_fp8, from_int4
from tests.fixtures.triton_checks import INTERPRETING, compile_for_h100, run_interpreted, runner_tokens

needs_triton = pytest.mark.skipif(not rtriton.available(), reason="triton is not installed")
N, K = 80, 72  # (neither a multiple of the kernel's 64 rows nor of its 32 columns)


def _int4(method: str, version: str = "gptq", seed: int = 0) -> tuple[DeviceQuantized, torch.Tensor]:
    """Random packed tensors of a GPTQ (act-order: a permutation's groups of 8) or AWQ (groups of 8 in order) module:
    (its device layout, prequantized.dequantize_int4's reading)."""
    g = torch.Generator().manual_seed(seed)

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)

    groups = K // 8
    scales = (torch.rand(groups, N, generator=g) * 0.1 + 0.01).half()
    config = {"group_size": 8, "checkpoint_format": version}
    if method == "gptq":
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[torch.randperm(K, generator=g)] = (torch.arange(K) // 8).int()
        parts = (words(K // 8, N), words(groups, N // 8), scales, g_idx)
    else:
        parts = (words(K, N // 8), words(groups, N // 8), scales, None)
    return from_int4(method, config, *parts), prequantized.dequantize_int4(method, config, *parts)


def _fp8(scaling: str, seed: int = 0) -> tuple[DeviceQuantized, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(N, K, generator=g) * 100).to(torch.float8_e4m3fn)
    values[0, :8] = torch.tensor([0.0, -0.0, 2 ** -9, -2 ** -8, 448.0, -448.0, 0.015625, 1.0]).to(torch.float8_e4m3fn)
    shapes = {"tensor": (1,), "row": (N, 1), "tile": (-(-N // 16), -(-K // 32))}
    scale = torch.rand(*shapes[scaling], generator=g) + 0.5
    block = [16, 32] if scaling == "tile" else None
    return from_fp8(values, scale, block), prequantized.dequantize_fp8(values.float(), scale, block)


CASES = [("gptq", "gptq"), ("gptq", "gptq_v2"), ("awq", "gemm"), ("fp8", "tensor"), ("fp8", "row"), ("fp8", "tile")]


def _case(kind: str, variant: str) -> tuple[DeviceQuantized, torch.Tensor]:
    return _fp8(variant) if kind == "fp8" else _int4(kind, variant)


@pytest.mark.parametrize(("kind", "variant"), CASES)
def test_the_device_layout_holds_the_cpu_runners_values(kind: str, variant: str) -> None:
    w, reference = _case(kind, variant)
    assert (w.rows, w.cols) == (N, K)
    assert torch.equal(w.dense(), reference)
    if kind != "fp8":  # (4 bits a value, as stored)
        assert w.values.shape == (N, K // 2) and w.values.dtype == torch.uint8


def test_a_scale_that_fits_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="fits neither"):
        from_fp8(torch.zeros(N, K).to(torch.float8_e4m3fn), torch.ones(3, 7), [16, 32])


@needs_triton
def test_kernels_under_interpreter():
    run_interpreted(__file__)


@needs_triton
@pytest.mark.slow
def test_checkpoints_end_to_end_under_interpreter():
    run_interpreted(__file__, "-k", "interpreted_checkpoints", "-m", "slow")


@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize(("kind", "variant"), CASES)
def test_interpreted_quant_matmul_matches_dense(kind: str, variant: str, m: int) -> None:
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.kernels.triton.quant_matmul import quant_matmul

    w, reference = _case(kind, variant)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    wide = torch.full((m, N + 16), 7.0)
    y = quant_matmul(x, w.kind, w.values, w.scales, w.zeros, w.groups, w.rows, w.cols, w.tile, out=wide[:, 8:8 + N])
    want = x.double() @ reference.double().T
    assert (y.double() - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())
    assert (wide[:, :8] == 7.0).all() and (wide[:, 8 + N:] == 7.0).all()  # (the slice's neighbours untouched)


@needs_triton
@pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET is set: kernels are interpreted here")
def test_kernels_compile_for_sm90() -> None:
    import runlm.kernels.triton.quant_matmul as qm

    kernel = qm._quant_matmul_kernel
    args = {"x_ptr": "*bf16", "v_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*fp32", "g_ptr": "*i32", "y_ptr": "*bf16"}
    args |= {name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_vn", "stride_sn", "stride_ym", "BR", "BC")}
    for kind in (qm.INT4, qm.FP8):
        for block_m in (16, 64):
            compile_for_h100(kernel, args, dict(KIND=kind, BLOCK_M=block_m, BLOCK_N=64, IEEE=False))


@pytest.mark.slow  # (interpreted end to end: test_checkpoints_end_to_end_under_interpreter runs it)
@pytest.mark.parametrize("checkpoint", ["gptq", "fp8-block"])
def test_interpreted_checkpoints_on_the_gpu_runner(monkeypatch, checkpoint: str) -> None:
    """A GPTQ (act-order) and a block-scaled FP8 checkpoint on the GPU runner, every layer's matrix kept as stored and
    multiplied by the kernel (interpreted); greedy tokens equal the torch runner's exact mode."""
    if not INTERPRETING:
        pytest.skip("runs in test_checkpoints_end_to_end_under_interpreter's child process")
    from runlm.engine.types.sampling_params import SamplingParams
    from runlm.models.linear import Linear
    from tests.engine.conftest import prompt_ids
    from tests.fixtures.models import fp8_model, int4_model

    def kept(llm) -> None:
        kept = [m for m in llm.engine.runner.loaded.model.modules() if isinstance(m, Linear) and m.device_blocks]
        assert kept and all(isinstance(s, DeviceQuantized) for m in kept for s in m.device_blocks)

    path = int4_model("gptq")[0] if checkpoint == "gptq" else fp8_model("block")[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt_ids(5 + 4 * i, seed=i)} for i in range(2)]
    tokens = runner_tokens(monkeypatch, path, prompts, greedy, kept)
    assert tokens[True] == tokens[False]
