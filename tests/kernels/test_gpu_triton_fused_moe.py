"""The GPU runner's mixture of experts (runlm/kernels/triton/fused_moe.py): pairs sorted by expert on the device, then
two grouped GEMMs over stacked experts (dense, or a GGUF's blocks), under Triton's interpreter on the CPU against a
token-by-token loop over the experts; compiled for sm_90; end to end, the GPU runner's tokens with the kernel
(interpreted) equal the torch runner's. As test_gpu_triton_attention.py, the interpreted tests run in a child
pytest with TRITON_INTERPRET=1."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runlm.kernels import triton as rtriton
from runlm.models.gpu_blocks import dequantize_on_device
from tests.fixtures.triton_checks import INTERPRETING, compile_for_h100, run_interpreted, runner_tokens
from tests.kernels.test_gpu_triton_ggml_matmul import TYPES, blocks

pytestmark = pytest.mark.skipif(not rtriton.available(), reason="triton is not installed")
CUDA = torch.cuda.is_available() and not INTERPRETING


def test_kernels_under_interpreter():
    run_interpreted(__file__)


@pytest.mark.slow
def test_moe_models_end_to_end_under_interpreter():
    run_interpreted(__file__, "-k", "interpreted_moe_models or interpreted_block", "-m", "slow")


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m"), [(1, 2, 8, 16), (5, 2, 8, 16), (40, 4, 6, 64),
                                                                      (3, 8, 64, 16)])
def test_pairs_are_sorted_by_expert_each_once_in_blocks_of_one_expert(tokens, top_k, experts, block_m):
    from runlm.kernels.triton.fused_moe import align_pairs

    g = torch.Generator().manual_seed(tokens)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    ids, block_expert = align_pairs(chosen, experts, block_m)
    pairs = tokens * top_k
    assert ids.numel() % block_m == 0 and block_expert.numel() == ids.numel() // block_m
    assert ids.numel() <= pairs + min(experts, pairs) * (block_m - 1) + block_m - 1  # (the fixed bound)
    real = ids[ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    assert ((ids == pairs) | (ids < pairs)).all()
    flat = chosen.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        rows = ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < pairs]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and (flat[rows] == e).all() and (rows.diff() > 0).all()
    used = block_expert[block_expert >= 0]
    assert (used.diff() > 0).all() and set(used.tolist()) == set(flat.tolist())  # one run per chosen expert


def _reference(x, weights, chosen, gate_up, down):
    """Token by token: sum of weight x down(SiLU(gate) * up) over the chosen experts, in float32."""
    out = torch.zeros(x.shape[0], down.shape[1])
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), chosen[t].tolist()):
            gate, up = (x[t].float() @ gate_up[e].float().T).chunk(2)
            out[t] += w * (F.silu(gate) * up) @ down[e].float().T
    return out


def _routing(tokens: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return weights, chosen


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_interpreted_dense_experts_equal_the_loop(tokens):
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.kernels.triton.fused_moe import DENSE, fused_experts

    experts, top_k, hidden, inter = 6, 2, 96, 80  # (neither a multiple of the 64-wide tiles: masked rows and K)
    g = torch.Generator().manual_seed(7)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(experts, hidden, inter, generator=g) * 0.1
    x = torch.randn(tokens, hidden, generator=g)
    weights, chosen = _routing(tokens, experts, top_k, tokens)
    got = fused_experts(x, weights, chosen, gate_up, DENSE, down, DENSE)
    assert got.shape == (tokens, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(x, weights, chosen, gate_up, down), atol=1e-4, rtol=1e-4)


# Q4_K by default (each type's decoding is ggml_matmul's, tested there); Q8_0 and Q6_K under make test-slow
@pytest.mark.parametrize("name,qtype,per_block,nbytes,scales",
                         [TYPES[2], *(pytest.param(*t, marks=pytest.mark.slow) for t in (TYPES[0], TYPES[4]))])
def test_interpreted_block_experts_equal_their_dequantized_loop(name, qtype, per_block, nbytes, scales):
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.kernels.triton.fused_moe import fused_experts

    experts, top_k, hidden, inter, tokens = 4, 2, 256, 256, 5
    gate_up = torch.stack([blocks(2 * inter, hidden, per_block, nbytes, scales, seed=e) for e in range(experts)])
    down = torch.stack([blocks(hidden, inter, per_block, nbytes, scales, seed=10 + e) for e in range(experts)])
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    weights, chosen = _routing(tokens, experts, top_k, 3)
    got = fused_experts(x, weights, chosen, gate_up, qtype, down, qtype)
    dense_gate_up = torch.stack([dequantize_on_device(w, name, (2 * inter, hidden)) for w in gate_up])
    dense_down = torch.stack([dequantize_on_device(w, name, (hidden, inter)) for w in down])
    want = _reference(x, weights, chosen, dense_gate_up, dense_down)
    torch.testing.assert_close(got, want, atol=1e-3 * want.abs().max().item(), rtol=1e-3)


def test_interpreted_rejects_experts_that_do_not_take_x():
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.kernels.triton.fused_moe import DENSE, fused_experts

    weights, chosen = _routing(2, 4, 2, 0)
    with pytest.raises(ValueError, match="take 32 inputs, not 64"):
        fused_experts(torch.zeros(2, 64), weights, chosen, torch.zeros(4, 16, 32), DENSE, torch.zeros(4, 64, 8), DENSE)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_on_cuda_in_bf16():
    from runlm.kernels.triton.fused_moe import DENSE, fused_experts

    experts, top_k, hidden, inter = 8, 2, 256, 192
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05, \
        torch.randn(experts, hidden, inter, generator=g) * 0.05
    for tokens in (1, 64):
        x = torch.randn(tokens, hidden, generator=g)
        weights, chosen = _routing(tokens, experts, top_k, tokens)
        want = _reference(x, weights, chosen, gate_up.bfloat16(), down.bfloat16())
        got = fused_experts(x.bfloat16().cuda(), weights.cuda(), chosen.cuda(), gate_up.bfloat16().cuda(), DENSE,
                            down.bfloat16().cuda(), DENSE)
        torch.testing.assert_close(got.float().cpu(), want, atol=0.05, rtol=0.05)


@pytest.mark.skipif(INTERPRETING or CUDA, reason="compiled and run on CUDA above; interpreted here")
def test_the_kernel_compiles_for_sm90_dense_and_for_every_block_type():
    from runlm.kernels.triton import fused_moe
    kernel = fused_moe._moe_kernel
    args = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "ids_ptr": "*i64", "block_expert_ptr": "*i64",
            "scale_ptr": "*fp32", "pairs": "i32", "N": "i32", "K": "i32", "stride_x": "i32", "expert_stride": "i64",
            "row_stride": "i32", "stride_y": "i32"}
    for block_m, row_div, scale in ((16, 2, False), (64, 1, True)):
        compile_for_h100(kernel, args | ({"y_ptr": "*fp32"} if scale else {}),
                         dict(ROW_DIV=row_div, SCALE=scale, QTYPE=0, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
                              IEEE=False))
    for _, qtype, *_ in TYPES:
        compile_for_h100(kernel, args | {"w_ptr": "*u8"}, dict(ROW_DIV=8, SCALE=False, QTYPE=qtype, BLOCK_M=16,
                                                               BLOCK_N=64, BLOCK_K=32, IEEE=False))


@pytest.mark.slow  # (interpreted end to end: test_moe_models_end_to_end_under_interpreter runs it)
@pytest.mark.parametrize(("recipe", "fmt"), [("qwen2-moe", "safetensors"), ("mixtral", "q8_0")])
def test_interpreted_moe_models_on_the_gpu_runner_give_the_torch_runners_tokens(tiny_model, monkeypatch, recipe, fmt):
    """A Qwen2-MoE (a gated shared expert) from safetensors and a Mixtral GGUF (its experts kept in Q8_0 blocks):
    every layer stacked, the fused kernel routing on the device; greedy tokens equal the torch runner's exact mode."""
    if not INTERPRETING:
        pytest.skip("runs in test_moe_models_end_to_end_under_interpreter's child process")
    from runlm.engine.types.sampling_params import SamplingParams
    from runlm.models.moe import SparseMoeBlock, host_routed_experts
    from tests.engine.conftest import prompt_ids
    from tests.fixtures.gguf_convert import converted_gguf

    def stacked(llm) -> None:
        model = llm.engine.runner.loaded.model
        assert host_routed_experts(model, "cpu") is None
        blocks = [m.stacked for m in model.modules() if isinstance(m, SparseMoeBlock)]
        assert blocks and all(s is not None for s in blocks)
        assert (blocks[0].gate_up_type != 0) == (fmt != "safetensors")

    path = tiny_model(recipe) if fmt == "safetensors" else converted_gguf(recipe, fmt)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt_ids(5 + 4 * i, seed=i)} for i in range(2)]
    tokens = runner_tokens(monkeypatch, path, prompts, greedy, stacked)
    assert tokens[True] == tokens[False]
