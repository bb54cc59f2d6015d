"""Tensor parallelism on the GPU runner, proven on the CPU (RUNLM_GPU_RUNNER=1, the ranks' collectives on gloo; on
CUDA they are NCCL's): ranks of the GPU runner over 2 or 4 real processes give the unsplit GPU runner's tokens,
each rank's cache holding its own KV heads, with prefix caching, chunked prefill and preemption; a GGUF's blocks
are cut as kept for the kernels; what the GPU runner's ranks do not run is refused by name."""
from __future__ import annotations

import pytest

from runlm.engine.llm import LLM
from runlm.engine.runners.tp_gpu import GPUTPRunner
from runlm.engine.types.sampling_params import SamplingParams
from runlm.models.linear import Linear
from runlm.models.tp_shard import RowParallel
from tests.engine.conftest import prompt_ids
from tests.fixtures.default_run import default_run

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
KW = dict(kv_cache_memory="64MiB", threads=1, block_size=4)


@pytest.fixture(autouse=True)
def gpu_runner(monkeypatch) -> None:
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1")
    monkeypatch.setenv("RUNLM_NATIVE_RUNNER", "0")


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _prompts(n: int = 3) -> list[list[int]]:
    return [prompt_ids(5 + 11 * i, seed=i) for i in range(n)]


@default_run("qwen2-2", "gemma3-2")  # (`make test-slow`: 4 ranks too)
@pytest.mark.parametrize(("recipe", "size"), [("qwen2", 2), ("llama", 4), ("gemma3", 2)])
def test_gpu_runner_ranks_give_the_unsplit_gpu_runners_tokens(tiny_model, recipe: str, size: int) -> None:
    """qwen2: biases, tied embeddings; llama at 4 ranks: 2 KV heads, each kept by two ranks; gemma3: its
    sliding-window layers' KV group. Seeded sampling too (only rank 0 samples)."""
    path = str(tiny_model(recipe))
    whole = LLM(path, **KW)
    seeded = SamplingParams(temperature=0.8, top_k=3, seed=5, max_tokens=10, ignore_eos=True)
    split = LLM(path, tensor_parallel_size=size, **KW)
    assert split.engine.runner_desc == "tensor-parallel gpu" and isinstance(split.engine.runner, GPUTPRunner)
    runner, cfg = split.engine.runner, split.engine.loaded.config
    assert runner.backend.caches[0][0].shape[2] == max(cfg.num_kv_heads // size, 1)  # its own KV heads
    assert _tokens(split, _prompts()) == _tokens(whole, _prompts())
    assert _tokens(split, _prompts(), seeded) == _tokens(whole, _prompts(), seeded)
    # one decode step: 2 all-reduces a layer (o_proj, down_proj) + the embedding's
    comm, engine = runner.group.comm, split.engine
    engine.add_request("one", {"prompt_token_ids": prompt_ids(9, seed=5)}, SamplingParams(max_tokens=4))
    for _ in range(2):
        before = comm.all_reduces
        engine.step()
        assert comm.all_reduces - before == 2 * cfg.num_layers + 1


def test_chunked_prefill_prefix_caching_and_preemption_across_gpu_ranks(tiny_model) -> None:
    path = str(tiny_model("qwen2"))
    shared = prompt_ids(24, seed=9)
    prompts = [shared + prompt_ids(6 + i, seed=20 + i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = LLM(path, **KW)
    expected = _tokens(roomy, prompts, params)
    tight = LLM(path, tensor_parallel_size=2, max_num_batched_tokens=16,
                **{**KW, "kv_cache_memory": 40 * 4 * roomy.engine.kv_bytes_per_token})
    assert _tokens(tight, prompts, params) == expected
    assert tight.engine.num_preemptions > 0 and tight.engine.stats().prefix_cache_hits > 0


def test_a_gguf_splits_in_its_blocks() -> None:
    from tests.fixtures.gguf_convert import converted_gguf

    path = str(converted_gguf("llama", "q8_0"))
    split = LLM(path, tensor_parallel_size=2, **KW)
    layer = split.engine.loaded.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, RowParallel) and layer.mlp.down_proj.device_blocks
    assert all(m.device_blocks and not m.ggml for m in layer.modules() if isinstance(m, Linear))
    assert _tokens(split, _prompts()) == _tokens(LLM(path, **KW), _prompts())


def test_what_the_gpu_runners_ranks_refuse(tiny_model) -> None:
    path = str(tiny_model("qwen2"))
    for kw, why in ((dict(enable_lora=True), "LoRA adapters on the GPU runner's ranks"),
                    (dict(n_gpu_layers=1), "layer offload"),
                    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
                     "speculative decoding")):
        with pytest.raises(ValueError, match=why):
            LLM(path, tensor_parallel_size=2, **KW, **kw)
