"""What a CUDA graph can hold: the GPU runner's decode forward (the part its graphs capture) reads nothing back to
the host and makes no tensor whose size depends on its values, for a mixture of experts (the fused experts kernel)
and for a batch with LoRA adapters (device slots) -- checked on the CPU under Triton's interpreter by watching every
aten op of the forward for the ones that sync (``.item()``/``.tolist()``, nonzero, unique, boolean indexing). The
host paths these replace are caught by the same watch (so it can fail). As test_gpu_triton_attention.py, the
interpreted tests run in a child pytest with TRITON_INTERPRET=1."""
from __future__ import annotations

import collections
import os

import pytest

from runlm.kernels import triton as rtriton
from tests.fixtures.triton_checks import run_interpreted

pytestmark = pytest.mark.skipif(not rtriton.available(), reason="triton is not installed")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
# ops that read values back, size a tensor by them, or bake host data into the step (torch.tensor(list) inside it)
SYNCS = {"_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
         "masked_select", "item", "lift_fresh"}


def _bool_index(args) -> bool:
    import torch

    indices = args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def test_kernels_under_interpreter():
    run_interpreted(__file__)


@pytest.mark.slow
def test_lora_under_interpreter():
    run_interpreted(__file__, "-k", "interpreted_lora", "-m", "slow")


def _forward_syncs(llm, monkeypatch, requests) -> collections.Counter[str]:
    """The syncing aten ops (SYNCS) of the model's forward in one decode step of ``requests`` [(prompt ids, lora)]."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    from runlm.engine.types.sampling_params import SamplingParams

    seen: collections.Counter[str] = collections.Counter()
    run = InterpretedFunction.run

    def interpreted(self, *args, **kwargs):
        with _disable_current_modes():  # (the interpreter's own tensor plumbing is not the kernel's)
            return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", interpreted)

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket).removeprefix("aten.")
            if name in SYNCS or name == "index" and _bool_index(args):
                seen[name] += 1
            return func(*args, **(kwargs or {}))

    model = llm.engine.runner.loaded.model
    forward = model.forward
    watching = {"on": False}

    def watched(*args, **kwargs):
        if not watching["on"]:
            return forward(*args, **kwargs)
        with Watch():
            return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", watched)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, (ids, lora) in enumerate(requests):
        llm.engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params, lora_request=lora)
    llm.engine.step()  # the prompts
    watching["on"] = True
    llm.engine.step()  # a decode step, watched
    return seen


def _llm(path, monkeypatch, **kw):
    from runlm.engine.llm import LLM

    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1")
    monkeypatch.setenv("RUNLM_NATIVE_RUNNER", "0")
    return LLM(str(path), block_size=4, max_num_batched_tokens=32, kv_cache_memory="16MiB", exact_numerics=True,
               max_model_len=64, enforce_eager=True, **kw)


def test_interpreted_a_mixture_of_experts_decodes_without_a_sync(tiny_model, monkeypatch):
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.models.moe import SparseMoeBlock

    llm = _llm(tiny_model("qwen2-moe"), monkeypatch)
    prompts = [(list(range(5, 12)), None), (list(range(20, 25)), None)]
    assert not _forward_syncs(llm, monkeypatch, prompts)
    for block in llm.engine.runner.loaded.model.modules():  # the host path it replaces: caught
        if isinstance(block, SparseMoeBlock):
            block.stacked = None
    assert _forward_syncs(_relaunched(llm), monkeypatch, prompts)


def _relaunched(llm):
    for rid in list(llm.engine.requests):
        llm.engine.abort_request(rid)
    return llm


@pytest.mark.slow  # (14 s interpreted: test_lora_under_interpreter runs it)
def test_interpreted_lora_adapters_decode_without_a_sync(tiny_model, monkeypatch):
    if not INTERPRETING:
        pytest.skip("runs in test_kernels_under_interpreter's child process")
    from runlm.engine.types.lora_request import LoRARequest
    from tests.fixtures.lora import peft_adapter

    llm = _llm(tiny_model("llama"), monkeypatch, enable_lora=True, max_loras=2, max_lora_rank=8)
    adapters = [LoRARequest(f"a{i}", i + 1, str(peft_adapter("llama", 8, seed=i))) for i in range(2)]
    prompts = [(list(range(5, 12)), adapters[0]), (list(range(20, 25)), None), (list(range(30, 36)), adapters[1])]
    assert not _forward_syncs(llm, monkeypatch, prompts)
    llm.engine.runner.lora_rows = None  # the host path (rows grouped by adapter): caught
    assert _forward_syncs(_relaunched(llm), monkeypatch, prompts)
