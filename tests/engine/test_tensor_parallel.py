"""Tensor parallelism on the CPU: the model split over 2 or 4 real processes talking over gloo gives the unsplit
model's greedy tokens in exact mode (fp32); a step costs 2 all-reduces a layer and 1 for the embedding; prefix
caching and preemption run as on one rank; a rank that dies stops the engine with its name; what the split does not
run is refused by name before any process starts."""
from __future__ import annotations

import asyncio

import pytest

from runlm.engine.async_llm import AsyncLLM, EngineDeadError
from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from runlm.models.tp_shard import Split
from tests.engine.conftest import prompt_ids
from tests.fixtures.default_run import default_run

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
EXACT = dict(exact_numerics=True, kv_cache_memory="64MiB", threads=1)


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _prompts(n: int = 3) -> list[list[int]]:
    return [prompt_ids(5 + 11 * i, seed=i) for i in range(n)]


# llama: 4 heads over 2 KV heads (at 4 ranks, two ranks keep each KV head); qwen2: q/k/v biases and tied
# embeddings; qwen3: per-head q/k norms
@default_run("qwen2-2", "llama-4")
@pytest.mark.parametrize(("recipe", "size"), [("llama", 2), ("qwen2", 2), ("qwen3", 2), ("llama", 4)])
def test_split_model_gives_the_unsplit_models_greedy_tokens(tiny_model, recipe: str, size: int) -> None:
    path = str(tiny_model(recipe))
    expected = _tokens(LLM(path, **EXACT), _prompts())
    split = LLM(path, tensor_parallel_size=size, **EXACT)
    assert split.engine.runner_desc == "tensor-parallel torch"
    assert _tokens(split, _prompts()) == expected
    # one step, prefill or decode: 2 all-reduces a layer (attention's o_proj, the MLP's down_proj) + the embedding's
    comm, engine = split.engine.runner.group.comm, split.engine
    engine.add_request("one", {"prompt_token_ids": prompt_ids(9, seed=5)}, SamplingParams(max_tokens=4))
    for _ in range(2):
        before = comm.all_reduces
        engine.step()
        assert comm.all_reduces - before == 2 * engine.loaded.config.num_layers + 1


# Gemma 2/3: sliding-window layers in a KV group of their own, soft-capping, sandwich norms; Phi-3: fused
# checkpoint projections, partial rotary and LongRoPE; Granite: multipliers; GLM-4: partial RoPE on pairs;
# Cohere 2: parallel attention and MLP under one LayerNorm, no RoPE on its global layers
# (the default run: Gemma 3 and GLM-4; the rest under make test-slow)
@pytest.mark.parametrize("recipe", ["gemma3", "glm4", *(pytest.param(r, marks=pytest.mark.slow)
                                                        for r in ("gemma2", "phi3", "granite", "cohere2"))])
def test_families_split_as_they_run_whole(tiny_model, recipe: str) -> None:
    path = str(tiny_model(recipe))
    assert _tokens(LLM(path, tensor_parallel_size=2, **EXACT), _prompts()) == _tokens(LLM(path, **EXACT), _prompts())


def test_prefix_caching_and_preemption_across_ranks(tiny_model) -> None:
    path = str(tiny_model("qwen2"))
    shared = prompt_ids(24, seed=9)
    prompts = [shared + prompt_ids(6 + i, seed=20 + i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = LLM(path, block_size=4, **EXACT)
    expected = _tokens(roomy, prompts, params)
    # 6 x (about 55 tokens) need about 85 blocks of 4; a cache of 40 preempts
    tight = LLM(path, block_size=4, tensor_parallel_size=2,
                **{**EXACT, "kv_cache_memory": 40 * 4 * roomy.engine.kv_bytes_per_token})
    assert len(tight.engine.blocks.blocks) == 40  # the ranks' caches together fit the budget the one rank's did
    assert _tokens(tight, prompts, params) == expected
    assert tight.engine.num_preemptions > 0
    assert tight.engine.stats().prefix_cache_hits > 0


def test_a_gguf_model_splits_in_exact_and_fast_mode() -> None:
    from tests.fixtures.gguf_convert import converted_gguf

    path = str(converted_gguf("llama", "q8_0"))
    # exact mode: int8 blocks cut at whole blocks, the same tokens
    assert _tokens(LLM(path, tensor_parallel_size=2, **EXACT), _prompts()) == _tokens(LLM(path, **EXACT), _prompts())
    # fast mode: GGUF blocks as stored, 8-bit activations (a rank's partial sums round differently from one rank's
    # whole sum, so the 8-bit activations of the next layer may differ in their last step): the same first token
    # and log-probabilities of one rank's tokens within 0.25
    fast = dict(kv_cache_memory="64MiB", threads=1)
    one = LLM(path, **fast).generate([{"prompt_token_ids": p} for p in _prompts()],
                                     SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    two = LLM(path, tensor_parallel_size=2, **fast).generate(
        [{"prompt_token_ids": p} for p in _prompts()], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            (token, lp), = pa.items()
            assert abs(lp.logprob - pb[token].logprob) < 0.25


def test_a_cut_inside_a_quantized_block_fails_every_rank_with_its_reason() -> None:
    from tests.fixtures.gguf_convert import converted_gguf

    # 4 ranks cut the 64-wide o_proj at column 16, inside a Q8_0 block of 32
    with pytest.raises(ValueError, match=r"could not load.*rank 0: ValueError: .*inside one of its 32-value .*rank 3"):
        LLM(str(converted_gguf("llama", "q8_0")), tensor_parallel_size=4, kv_cache_memory="64MiB", threads=1)


def test_a_dead_rank_stops_the_engine_with_its_name(tiny_model) -> None:
    llm = LLM(str(tiny_model("llama")), tensor_parallel_size=2, **EXACT)
    assert _tokens(llm, _prompts(1))
    worker = llm.engine.runner.group.processes[0]
    worker.kill()
    worker.wait()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited \(code -9\)"):
        llm.engine.check_alive()
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        _tokens(llm, _prompts(1))


def test_health_reports_a_dead_rank_while_idle(tiny_model) -> None:
    async def main() -> None:
        llm = AsyncLLM(str(tiny_model("llama")), tensor_parallel_size=2, **EXACT)
        try:
            await llm.check_health()
            llm.engine.runner.group.processes[0].kill()
            llm.engine.runner.group.processes[0].wait()
            with pytest.raises(EngineDeadError, match="rank 1 exited"):
                await llm.check_health()
        finally:
            llm.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("recipe", ["llama", "phi3"])
def test_lora_adapters_are_cut_with_their_layers(tiny_model, recipe: str) -> None:
    """Each rank attaches its cut of the adapter (B's rows of qkv/gate_up, A's columns of o/down); a step mixing
    two adapters and none gives one rank's tokens; an adapter removed is gone on every rank. Phi-3's adapter is on
    its fused qkv_proj and gate_up_proj."""
    from runlm.engine.types.lora_request import LoRARequest
    from tests.fixtures.lora import peft_adapter

    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if recipe == "phi3" else \
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = [LoRARequest(f"a{i}", i + 1, str(peft_adapter(recipe, 8, seed=i, targets=targets))) for i in range(2)]
    path, lora = str(tiny_model(recipe)), dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    per_prompt = [adapters[0], None, adapters[1]]
    one = LLM(path, **EXACT, **lora).generate(prompts, GREEDY, lora_request=per_prompt)
    split = LLM(path, tensor_parallel_size=2, **EXACT, **lora)
    two = split.generate(prompts, GREEDY, lora_request=per_prompt)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert two[0].outputs[0].token_ids != two[1].outputs[0].token_ids  # (the adapters change the answer)
    assert split.engine.remove_lora(1)
    base = split.generate(prompts[:1], GREEDY)[0].outputs[0].token_ids
    assert base == split.generate(prompts[:1], GREEDY, lora_request=None)[0].outputs[0].token_ids
    assert base == LLM(path, **EXACT).generate(prompts[:1], GREEDY)[0].outputs[0].token_ids


def test_speculative_decoding_verifies_on_every_rank(tiny_model) -> None:
    """A draft model on rank 0 proposes; every rank computes the 1 + k rows, rank 0 verifies; rejected drafts'
    K/V is overwritten on every rank alike: one rank's greedy tokens, some drafts accepted and some not."""
    from tests.fixtures.near_copy import near_copy

    path = str(tiny_model("qwen2"))
    spec = {"model": str(near_copy("qwen2", noise=0.05)), "num_speculative_tokens": 3, "min_acceptance_rate": 0.0}
    expected = _tokens(LLM(path, **EXACT), _prompts(), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    split = LLM(path, tensor_parallel_size=2, speculative_config=spec, **EXACT)
    assert _tokens(split, _prompts(), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) == expected
    stats = split.engine.spec_decode_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize(("recipe", "args", "reason"), [
    ("mixtral", {}, "mixtures of experts"),
    ("llama", {"tensor_parallel_size": 3}, "4 attention heads, which 3 ranks cannot share evenly"),
    ("olmo2", {}, r"q/k norms over the whole projection \(OLMo 2's\)"),
])
def test_what_the_split_does_not_run_is_refused_by_name(tiny_model, recipe: str, args: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=f"tensor parallelism .* does not run {reason}"):
        LLM(str(tiny_model(recipe)), **{"tensor_parallel_size": 2, **EXACT, **args})


def test_each_rank_keeps_its_heads_and_vocabulary() -> None:
    # 8 query heads over 2 KV heads at 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1
    assert [Split(r, 4, 8, 2).first_kv_head for r in range(4)] == [0, 0, 1, 1]
    assert [Split(r, 2, 8, 4).first_kv_head for r in range(2)] == [0, 2]
    assert Split(0, 4, 8, 2).local_kv_heads == 1
    # a vocabulary that does not split evenly: ceil(n / size) rows a rank, the last rank's fewer
    assert [Split(r, 4, 8, 8).vocab(10) for r in range(4)] == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]
