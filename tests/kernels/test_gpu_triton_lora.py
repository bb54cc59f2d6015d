"""The GPU runner's LoRA kernels (runlm/kernels/triton/lora.py): each row's adapter slot picks its A and B, rows
without one are left as they are; under Triton's interpreter on the CPU against a row-by-row torch update and the
slots' torch ops (runlm.models.lora._add_by_slot); compiled for sm_90; end to end (slow), the GPU runner with
adapters in device slots and the kernels interpreted gives the torch runner's tokens. As test_gpu_triton_attention.py,
the interpreted tests run in a child pytest with TRITON_INTERPRET=1."""
from __future__ import annotations

import pytest
import torch

from runlm.kernels import triton as rtriton
from tests.fixtures.triton_checks import INTERPRETING, compile_for_h100, run_interpreted, runner_tokens

pytestmark = pytest.mark.skipif(not rtriton.available(), reason="triton is not installed")
CUDA = torch.cuda.is_available() and not INTERPRETING


def test_kernels_under_interpreter():
    run_interpreted(__file__)


@pytest.mark.slow
def test_lora_on_the_gpu_runner_under_interpreter():
    run_interpreted(__file__, "-k", "interpreted_lora_on_the_gpu_runner", "-m", "slow")


def _case(dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    slots, rank, k, n = 3, 24, 200, 80  # (K past one 128-wide step, N not a multiple of the 64-wide tiles)
    a = (torch.randn(slots, rank, k, generator=g) * 0.2).to(device=device, dtype=dtype)
    b = (torch.randn(slots, n, rank, generator=g) * 0.2).to(device=device, dtype=dtype)
    x = torch.randn(7, k, generator=g).to(device=device, dtype=dtype)
    y = torch.randn(7, n, generator=g).to(device=device, dtype=dtype)
    rows = torch.tensor([-1, 0, 2, 1, -1, 2, 0], dtype=torch.int32, device=device)
    return x, y, a, b, rows


def _reference(x, y, a, b, rows) -> torch.Tensor:
    out = y.float().clone()
    for t, s in enumerate(rows.tolist()):
        if s >= 0:
            out[t] += (x[t].float() @ a[s].float().T) @ b[s].float().T
    return out


def test_interpreted_each_row_takes_its_slots_update():
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.kernels.triton.lora import add_lora
    from runlm.models.lora import _add_by_slot

    x, y, a, b, rows = _case(torch.float32)
    want = _reference(x, y, a, b, rows)
    got = add_lora(x, y.clone(), a, b, rows)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[rows < 0], y[rows < 0])  # (rows without an adapter: untouched, bit for bit)
    by_slot = y.clone()
    _add_by_slot(x, by_slot, a, b, rows)
    torch.testing.assert_close(by_slot, want, atol=1e-4, rtol=1e-4)
    wide = torch.zeros(7, 100)  # a row stride wider than N (a view of a fused layer's output is contiguous rows)
    add_lora(x, wide[:, :80], a, b, rows)
    torch.testing.assert_close(wide[:, :80], want - y, atol=1e-4, rtol=1e-4)


def test_interpreted_rejects_slots_that_do_not_fit():
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.kernels.triton.lora import add_lora

    x, y, a, b, rows = _case(torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        add_lora(x[:, :100], y, a, b, rows)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_on_cuda_in_bf16():
    from runlm.kernels.triton.lora import add_lora

    x, y, a, b, rows = _case(torch.bfloat16, "cuda")
    torch.testing.assert_close(add_lora(x, y.clone(), a, b, rows).float(), _reference(x, y, a, b, rows),
                               atol=0.1, rtol=0.05)


@pytest.mark.skipif(INTERPRETING or CUDA, reason="compiled and run on CUDA above; interpreted here")
def test_the_kernels_compile_for_sm90():
    from runlm.kernels.triton import lora
    compile_for_h100(lora._shrink_kernel, {"x_ptr": "*bf16", "a_ptr": "*bf16", "h_ptr": "*fp32", "slots_ptr": "*i32",
                                           "K": "i32", "R": "i32", "stride_x": "i32", "stride_as": "i32",
                                           "stride_ar": "i32", "stride_h": "i32"}, dict(BLOCK_R=64, BLOCK_K=128))
    compile_for_h100(lora._expand_kernel, {"h_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "slots_ptr": "*i32",
                                           "N": "i32", "R": "i32", "stride_h": "i32", "stride_bs": "i32",
                                           "stride_bn": "i32", "stride_y": "i32"}, dict(BLOCK_N=64, BLOCK_R=64))


@pytest.mark.slow  # (interpreted end to end: test_lora_on_the_gpu_runner_under_interpreter runs it)
def test_interpreted_lora_on_the_gpu_runner_gives_the_torch_runners_tokens(tiny_model, monkeypatch):
    """Two adapters and the base in one batch on the GPU runner, the adapters in device slots and added by the
    Triton kernels (interpreted): greedy tokens equal the torch runner's (its rows grouped by adapter)."""
    if not INTERPRETING:
        pytest.skip("runs in test_lora_on_the_gpu_runner_under_interpreter's child process")
    from runlm.engine.types.lora_request import LoRARequest
    from runlm.engine.types.sampling_params import SamplingParams
    from tests.engine.conftest import prompt_ids
    from tests.fixtures.lora import peft_adapter

    def in_slots(llm) -> None:
        assert llm.engine.runner.lora_rows is not None

    adapters = [LoRARequest(f"a{i}", i + 1, str(peft_adapter("llama", 8, seed=i))) for i in range(2)]
    prompts = [{"prompt_token_ids": prompt_ids(5 + 4 * i, seed=i)} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    tokens = runner_tokens(monkeypatch, tiny_model("llama"), prompts, greedy, in_slots,
                           lora_request=[adapters[0], None, adapters[1]], enable_lora=True, max_loras=2,
                           max_lora_rank=8)
    assert tokens[True] == tokens[False]
    assert tokens[True][0] != tokens[True][1]  # (an adapter changes the answer)
