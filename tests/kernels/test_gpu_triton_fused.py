"""The GPU runner's fused small ops (runlm/kernels/triton/fused.py) under Triton's interpreter against the torch
formulas they replace (runlm.models.llama's RMSNorm, the residual add, SiLU * up), fp32 and bf16, rows of any
stride; compiled for sm_90 ahead of time. As the other Triton tests, the interpreted ones run in a child pytest."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from runlm.kernels import triton as rtriton
from tests.fixtures.triton_checks import compile_for_h100, run_interpreted

pytestmark = pytest.mark.skipif(not rtriton.available(), reason="triton is not installed")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRETING


def test_kernels_under_interpreter():
    run_interpreted(__file__)


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _check(ops, dtype: torch.dtype, device: str) -> None:
    g = torch.Generator().manual_seed(0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for rows, n in [(1, 64), (5, 96), (3, 1000)]:
        base = torch.randn(rows, 2 * n, generator=g).to(device=device, dtype=dtype)
        x = base[:, :n]  # rows strided: a slice of a wider tensor
        y = torch.randn(rows, n, generator=g).to(device=device, dtype=dtype)
        w = (1 + 0.1 * torch.randn(n, generator=g)).to(device=device, dtype=dtype)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), _torch_rms_norm(x, w, 1e-6), **tol)
        total, normed = ops.add_rms_norm(x, y, w, 1e-6)
        if dtype == torch.float32:
            assert torch.equal(total, x + y)
        else:  # (the interpreter rounds to bf16 by truncation: a unit in the last place)
            torch.testing.assert_close(total, x + y, atol=0, rtol=1e-2)
        torch.testing.assert_close(normed, _torch_rms_norm(x + y, w, 1e-6), **tol)
        gate, up = base.chunk(2, dim=-1)
        out = ops.silu_mul(base.reshape(rows, 1, 2 * n))
        assert out.shape == (rows, 1, n)
        torch.testing.assert_close(out.reshape(rows, n), F.silu(gate) * up, **tol)
        assert ops.rms_norm(x[:0], w, 1e-6).shape == (0, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_each_op_equals_the_torch_formula(dtype):
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.kernels.triton import fused
    _check(fused, dtype, "cpu")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda(dtype):
    from runlm.kernels.triton import fused
    _check(fused, dtype, "cuda")


@pytest.mark.skipif(INTERPRETING or CUDA, reason="compiled and run on CUDA above; interpreted here")
def test_the_kernels_compile_for_sm90():
    from runlm.kernels.triton import fused
    for add in (False, True):
        args = {"x_ptr": "*bf16", "y_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
                "stride_x": "i32", "stride_y": "i32", "stride_out": "i32", "stride_sum": "i32", "n": "i32",
                "eps": "fp32"}
        compile_for_h100(fused._rms_norm_kernel, args, dict(ADD=add, BLOCK=2048))
    compile_for_h100(fused._silu_mul_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16", "stride_gu": "i32",
                                              "stride_out": "i32", "n": "i32"}, dict(BLOCK=1024))


def _check_rope(ops, dtype: torch.dtype, device: str) -> None:
    from runlm.models.rope import RotaryEmbedding
    g = torch.Generator().manual_seed(1)
    for head_dim, rotary, interleaved in [(64, 64, False), (64, 64, True), (80, 40, False), (64, 32, True)]:
        rope = RotaryEmbedding(head_dim, 10000.0, None, 64, rotary_dim=rotary)
        if interleaved:
            rope.use_interleaved_pairs()
        qkv = torch.randn(5, (6 + 2 * 2) * head_dim, generator=g).to(device=device, dtype=dtype)
        q, k, _ = qkv.split([6 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
        q, k = q.reshape(5, 6, head_dim), k.reshape(5, 2, head_dim)  # strided views, as the layer has them
        positions = torch.tensor([0, 3, 17, 40, 63], device=device)
        want_q, want_k = rope(positions, q, k)
        got_q, got_k = ops.rope(q, k, positions, rope.cos.to(device), rope.sin.to(device), interleaved)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got_q, want_q, **tol)
        torch.testing.assert_close(got_k, want_k, **tol)


def _check_rope_store(ops, dtype: torch.dtype, device: str) -> None:
    """rope_store: q as rope rotates it; the rotated k and v in the caches at the slots (a slot of -1 writes
    nothing), everything else in the caches untouched."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 6, 64, generator=g).to(device=device, dtype=dtype)
    k, v = (torch.randn(4, 2, 64, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    positions = torch.tensor([5, 6, 7, 30], device=device)
    from runlm.models.rope import RotaryEmbedding
    rope = RotaryEmbedding(64, 10000.0, None, 64)
    cos, sin = rope.cos.to(device), rope.sin.to(device)
    k_cache, v_cache = (torch.full((6, 4, 2, 64), 9.0, dtype=dtype, device=device) for _ in range(2))
    slots = torch.tensor([9, 2, -1, 17], device=device)
    got_q = ops.rope_store(q, k, v, positions, cos, sin, False, k_cache, v_cache, slots)
    want_q, want_k = ops.rope(q, k, positions, cos, sin, False)
    assert torch.equal(got_q, want_q)
    flat_k, flat_v = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], want_k[i]) and torch.equal(flat_v[slot], v[i])
    untouched = [s for s in range(24) if s not in (9, 2, 17)]
    assert (flat_k[untouched] == 9).all() and (flat_v[untouched] == 9).all()
    # Qwen3's per-head q/k RMSNorm folded in: the norm's own launch, then the rotation, bit for bit
    qw, kw = (torch.rand(64, generator=g).add(0.5).to(device=device, dtype=dtype) for _ in range(2))
    got_q = ops.rope_store(q, k, v, positions, cos, sin, False, k_cache, v_cache, slots, (qw, kw, 1e-6))
    want_q, want_k = ops.rope(ops.rms_norm(q, qw, 1e-6), ops.rms_norm(k, kw, 1e-6), positions, cos, sin, False)
    assert torch.equal(got_q, want_q)
    assert torch.equal(flat_k[9], want_k[0]) and torch.equal(flat_k[17], want_k[3])
    assert not torch.equal(want_q, ops.rope(q, k, positions, cos, sin, False)[0])  # (the norms change q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_rope_equals_the_torch_rotation_and_stores_keys_in_the_cache(dtype):
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.kernels.triton import fused
    _check_rope(fused, dtype, "cpu")
    _check_rope_store(fused, dtype, "cpu")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_rope_on_cuda():
    from runlm.kernels.triton import fused
    _check_rope(fused, torch.bfloat16, "cuda")
    _check_rope_store(fused, torch.bfloat16, "cuda")


@pytest.mark.skipif(INTERPRETING or CUDA, reason="compiled and run on CUDA above; interpreted here")
def test_the_rope_kernel_compiles_for_sm90():
    from runlm.kernels.triton import fused
    kernel = fused._rope_kernel
    args = {name: "i32" for name in kernel.arg_names if name.startswith("stride")}
    args |= {"q_ptr": "*bf16", "k_ptr": "*bf16", "q_out_ptr": "*bf16", "k_out_ptr": "*bf16", "cos_ptr": "*fp32",
             "sin_ptr": "*fp32", "pos_ptr": "*i64"}
    consts = dict(HEADS=12, KV_HEADS=2, HEADS_P=16, HEAD_DIM=128, HEAD_DIM_P=128)
    for interleaved, rotary in ((False, 128), (True, 64)):
        compile_for_h100(kernel, args, dict(consts, ROTARY=rotary, INTERLEAVED=interleaved))
    store = fused._rope_store_kernel
    args = {name: "i32" for name in store.arg_names if name.startswith("stride")}
    args |= {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "q_out_ptr": "*bf16", "k_cache_ptr": "*bf16",
             "v_cache_ptr": "*bf16", "slot_ptr": "*i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64"}
    args |= {"qw_ptr": "*bf16", "kw_ptr": "*bf16", "eps": "fp32"}
    for norm, fp8 in ((False, False), (True, False), (False, True)):  # (fp8: the cache's bytes, --kv-cache-dtype fp8)
        cache = "*u8" if fp8 else "*bf16"
        compile_for_h100(store, args | {"k_cache_ptr": cache, "v_cache_ptr": cache},
                         dict(consts, ROTARY=128, INTERLEAVED=False, BLOCK_SIZE=16, NORM=norm, FP8=fp8))


@pytest.mark.parametrize("recipe", ["qwen2", "qwen3"])
def test_interpreted_a_decode_step_stays_within_its_launch_budget(monkeypatch, recipe):
    """The GPU runner's decode step, counted on the CPU: Triton launches (interpreted) plus the aten ops that launch
    a kernel on CUDA (views, reshapes and allocations do not). A tiny Qwen2 (2 layers, q/k/v biases): 10 a layer
    (4 matmuls, 2 norms each with the residual add before it, RoPE with the KV store, attention and its merge,
    SiLU * up) and 13 a step (the embedding, the final norm, the LM head, the step's input copies, the sampler). A
    Qwen3 the same: its per-head q/k norms inside the RoPE launch. A fused op that falls back to torch's several
    shows here."""
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    import collections
    import importlib

    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    from runlm.engine.llm import LLM
    from runlm.engine.types.sampling_params import SamplingParams
    from tests.fixtures.models import build_model

    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1")
    monkeypatch.setenv("RUNLM_NATIVE_RUNNER", "0")
    # the CPU's C++ matmul is invisible to the dispatcher: torch's F.linear stands for cuBLAS's one launch
    monkeypatch.setattr(importlib.import_module("runlm.kernels.linear"), "available", lambda: False)
    launches: collections.Counter[str] = collections.Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        with _disable_current_modes():  # (the interpreter's own tensor plumbing is not the kernel's)
            return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    free = {"view", "reshape", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "transpose", "t", "permute",
            "split", "split_with_sizes", "chunk", "unflatten", "flatten", "expand", "as_strided", "alias", "detach",
            "empty", "empty_like", "empty_strided", "new_empty", "resolve_conj", "resolve_neg", "promote_types",
            "lift_fresh", "set_"}

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket).removeprefix("aten.")
            if name not in free:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    llm = LLM(str(build_model(recipe)), block_size=4, max_num_batched_tokens=32, kv_cache_memory="16MiB",
              exact_numerics=True, max_model_len=64, enforce_eager=True)
    engine, layers = llm.engine, llm.engine.runner.loaded.config.num_layers
    engine.add_request("r", {"prompt_token_ids": list(range(5, 12))},
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prompt
    engine.step()
    launches.clear()
    with Ops() as counter:
        engine.step()  # one decode step
    total = sum(counter.ops.values()) + sum(launches.values())
    assert launches["_rms_norm_kernel"] == 2 * layers + 1 and launches["_rope_store_kernel"] == layers, launches
    assert counter.ops["add"] == 0, counter.ops  # (every residual add inside a norm's launch)
    assert total <= 10 * layers + 13, (total, counter.ops, launches)
    outs = []  # and the fused step computes what the torch runner does: the same greedy tokens to the end
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "0")
    want = LLM(str(build_model(recipe)), block_size=4, max_num_batched_tokens=32, kv_cache_memory="16MiB",
               exact_numerics=True, max_model_len=64).generate([{"prompt_token_ids": list(range(5, 12))}],
                                                               SamplingParams(temperature=0.0, max_tokens=4,
                                                                              ignore_eos=True))
    assert outs[0].outputs[0].token_ids == want[0].outputs[0].token_ids
