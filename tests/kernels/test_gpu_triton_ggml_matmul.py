"""The GPU runner's GGUF linear layer (runlm/kernels/triton/ggml_matmul.py): y = x @ W^T with W in its ggml blocks,
under Triton's interpreter on the CPU against the torch dequantizers (runlm.models.gpu_load) and a dense matmul, for
every block type it reads, decode (M = 1) and prefill shapes, a column slice of a wider output; on CUDA where there
is one. As test_gpu_triton_attention.py, the interpreted tests run in a child pytest with TRITON_INTERPRET=1."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runlm.kernels import triton as rtriton
from runlm.models.gpu_blocks import dequantize_on_device
from tests.fixtures.triton_checks import INTERPRETING, compile_for_h100, run_interpreted, runner_tokens

pytestmark = pytest.mark.skipif(not rtriton.available(), reason="triton is not installed")
CUDA = torch.cuda.is_available() and not INTERPRETING
# name, ggml type, values and bytes per block, where each block's fp16 scales sit
TYPES = [("Q8_0", 8, 32, 34, (0,)), ("Q4_0", 2, 32, 18, (0,)), ("Q4_K", 12, 256, 144, (0, 2)),
         ("Q5_K", 13, 256, 176, (0, 2)), ("Q6_K", 14, 256, 210, (208,))]


def test_kernels_under_interpreter():
    run_interpreted(__file__)


@pytest.mark.slow
def test_a_gguf_end_to_end_under_interpreter():
    run_interpreted(__file__, "-k", "interpreted_a_gguf", "-m", "slow")


def blocks(rows: int, k: int, per_block: int, nbytes: int, scales: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random ggml rows: every byte random but the blocks' fp16 scales, which are small finite numbers."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // per_block, nbytes), dtype=np.uint8)
    for at in scales:
        raw[:, :, at:at + 2] = rng.uniform(-0.05, 0.05, size=raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def _check(matmul, name: str, qtype: int, per_block: int, nbytes: int, scales: tuple[int, ...], m: int,
           dtype: torch.dtype, device: str, atol: float) -> None:
    n, k = 80, 512  # N not a multiple of the tile: masked rows
    raw = blocks(n, k, per_block, nbytes, scales, seed=qtype).to(device)
    w = dequantize_on_device(raw, name, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device=device, dtype=dtype)
    want = (x.float() @ w.T.to(dtype).float())
    got = matmul(x, raw, qtype)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=1e-3 if dtype == torch.float32 else 2e-2)
    wide = torch.full((m, n + 24), 7.0, dtype=dtype, device=device)  # a column slice of a wider output
    matmul(x, raw, qtype, out=wide[:, 16:16 + n])
    torch.testing.assert_close(wide[:, 16:16 + n], got)
    assert (wide[:, :16] == 7).all() and (wide[:, 16 + n:] == 7).all()


@pytest.mark.parametrize("name,qtype,per_block,nbytes,scales", TYPES)
@pytest.mark.parametrize("m", [1, 5, 40])
def test_interpreted_each_type_equals_its_dequantized_matmul(name, qtype, per_block, nbytes, scales, m):
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.kernels.triton.ggml_matmul import ggml_matmul
    _check(ggml_matmul, name, qtype, per_block, nbytes, scales, m, torch.float32, "cpu", atol=1e-3)


def test_interpreted_rejects_rows_that_do_not_hold_k():
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.kernels.triton.ggml_matmul import ggml_matmul
    with pytest.raises(ValueError, match="do not hold K=64"):
        ggml_matmul(torch.zeros(1, 64), torch.zeros(4, 35, dtype=torch.uint8), 8)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name,qtype,per_block,nbytes,scales", TYPES)
@pytest.mark.parametrize("m", [1, 40])
def test_on_cuda_in_bf16(name, qtype, per_block, nbytes, scales, m):
    from runlm.kernels.triton.ggml_matmul import ggml_matmul
    _check(ggml_matmul, name, qtype, per_block, nbytes, scales, m, torch.bfloat16, "cuda", atol=0.5)


@pytest.mark.skipif(INTERPRETING or CUDA, reason="compiled and run on CUDA above; interpreted here")
def test_the_kernel_compiles_for_sm90_for_every_type():
    from runlm.kernels.triton import ggml_matmul
    kernel = ggml_matmul._ggml_matmul_kernel
    args = {"x_ptr": "*bf16", "w_ptr": "*u8", "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
            "row_bytes": "i32", "stride_ym": "i32"}
    for _, qtype, *_ in TYPES:
        for block_m in (16, 64):
            compile_for_h100(kernel, args, dict(QTYPE=qtype, BLOCK_M=block_m, BLOCK_N=64, IEEE=False))
    compile_for_h100(kernel, args | {"x_ptr": "*fp32", "y_ptr": "*fp32"}, dict(QTYPE=12, BLOCK_M=16, BLOCK_N=64,
                                                                                IEEE=True))


@pytest.mark.slow  # (about 15 s interpreted: test_a_gguf_end_to_end_under_interpreter runs it)
def test_interpreted_a_gguf_on_the_gpu_runner_gives_the_torch_runners_tokens(monkeypatch):
    """End to end: a Q8_0 GGUF on the GPU runner, its matrices kept in their blocks and multiplied by the Triton
    kernel (interpreted), the attention Triton's too; greedy tokens equal the torch runner's exact mode."""
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.engine.runners.gpu import GPURunner
    from runlm.engine.types.sampling_params import SamplingParams
    from runlm.models.linear import Linear
    from tests.engine.conftest import prompt_ids
    from tests.fixtures.gguf_convert import converted_gguf

    def kept_in_blocks(llm) -> None:
        assert isinstance(llm.engine.runner, GPURunner)
        assert any(isinstance(m, Linear) and m.device_blocks for m in llm.engine.runner.loaded.model.modules())

    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt_ids(5 + 4 * i, seed=i)} for i in range(2)]  # (batched: 2 rows a step)
    tokens = runner_tokens(monkeypatch, converted_gguf("llama", "q8_0"), prompts, greedy, kept_in_blocks)
    assert tokens[True] == tokens[False]
