"""Continuous batching: outputs do not depend on what else runs, how prompts are chunked,
whether a request was preempted, or whether its prefix came from the cache."""
from __future__ import annotations

import pytest

from runlm.engine.llm import LLM
from runlm.engine.types.errors import PromptError
from runlm.engine.types.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_output_is_the_same_alone_or_among_31_others(llm: LLM, params: SamplingParams) -> None:
    prompts = [{"prompt_token_ids": prompt_ids(5 + 7 * i, seed=i)} for i in range(32)]
    together = _tokens(llm.generate(prompts, params))
    for i in (0, 13, 31):
        assert _tokens(llm.generate([prompts[i]], params))[0] == together[i]


def test_long_prompt_is_prefilled_in_chunks_alongside_decodes(tiny_model) -> None:
    chunked = LLM(str(tiny_model("qwen2")), block_size=4, max_num_batched_tokens=16, kv_cache_memory="64MiB")
    whole = LLM(str(tiny_model("qwen2")), block_size=4, max_num_batched_tokens=1024, kv_cache_memory="64MiB")
    prompts = [{"prompt_token_ids": prompt_ids(300, seed=1)}, {"prompt_token_ids": prompt_ids(6, seed=2)}]
    assert _tokens(chunked.generate(prompts, GREEDY)) == _tokens(whole.generate(prompts, GREEDY))


def test_preempted_requests_resume_with_identical_output(tiny_model) -> None:
    prompts = [{"prompt_token_ids": prompt_ids(30 + i, seed=10 + i)} for i in range(8)]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    roomy = LLM(str(tiny_model("qwen2")), block_size=4, kv_cache_memory="64MiB")
    # 8 x (about 70 tokens) need about 140 blocks of 4; give the cache 60 so requests get preempted
    tight = LLM(str(tiny_model("qwen2")), block_size=4, kv_cache_memory=60 * 4 * roomy.engine.kv_bytes_per_token)
    expected = _tokens(roomy.generate(prompts, params))
    assert _tokens(tight.generate(prompts, params)) == expected
    assert tight.engine.num_preemptions > 0


def test_priority_then_arrival_order(tiny_model) -> None:
    one_at_a_time = LLM(str(tiny_model("qwen2")), max_num_seqs=1, kv_cache_memory="64MiB")
    engine = one_at_a_time.engine
    for rid, prio in (("late-low", 5), ("urgent", -1), ("normal-a", 0), ("normal-b", 0)):
        engine.add_request(rid, {"prompt_token_ids": prompt_ids(8, seed=3)},
                           SamplingParams(max_tokens=2, ignore_eos=True), priority=prio)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["urgent", "normal-a", "normal-b", "late-low"]


def test_prompt_longer_than_context_is_refused_up_front(llm: LLM) -> None:
    limit = llm.engine.max_model_len
    with pytest.raises(PromptError, match=f"{limit + 5} tokens.*{limit}"):
        llm.generate([{"prompt_token_ids": prompt_ids(limit + 5, seed=0)}], GREEDY)
    with pytest.raises(PromptError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], GREEDY)
    with pytest.raises(PromptError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 10**9]}], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_prefix_cache_hits_reuse_and_reset(llm: LLM) -> None:
    llm.reset_prefix_cache()
    shared = prompt_ids(64, seed=5)
    first = llm.generate([{"prompt_token_ids": shared + [11, 12]}], GREEDY)[0]
    second = llm.generate([{"prompt_token_ids": shared + [11, 12]}], GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 64
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == 64 and stats.prefix_cache_queries == 2 * 66
    llm.reset_prefix_cache()
    third = llm.generate([{"prompt_token_ids": shared + [11, 12]}], GREEDY)[0]
    assert third.num_cached_tokens == 0 and third.outputs[0].token_ids == first.outputs[0].token_ids


def test_no_memory_growth_over_thousands_of_requests(llm: LLM) -> None:
    engine = llm.engine
    before = (len(engine.blocks.blocks), sum(k.numel() for k, _ in engine.runner.kv_caches))
    prompts = [{"prompt_token_ids": prompt_ids(9, seed=i)} for i in range(2000)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert (len(engine.blocks.blocks), sum(k.numel() for k, _ in engine.runner.kv_caches)) == before
    assert len(engine.blocks.cached) <= len(engine.blocks.blocks)
    assert engine.blocks.num_free_blocks == len(engine.blocks.blocks)
    assert not engine.requests and not engine.structured.seqs  # stop ids now live on the sequence


def test_a_sequence_that_outgrows_the_whole_cache_finishes_and_never_blocks_the_queue(tiny_model, caplog) -> None:
    """Issue 15 #1: it used to be preempted, then wait forever at the head of the queue."""
    roomy = LLM(str(tiny_model("qwen2")), block_size=4, kv_cache_memory="64MiB")
    # 10 blocks of 4 tokens: 40 tokens in all, far less than the context
    tight = LLM(str(tiny_model("qwen2")), block_size=4, kv_cache_memory=10 * 4 * roomy.engine.kv_bytes_per_token)
    engine = tight.engine
    engine.add_request("long", {"prompt_token_ids": prompt_ids(8, seed=1)},
                       SamplingParams(max_tokens=500, ignore_eos=True))
    engine.add_request("short", {"prompt_token_ids": prompt_ids(5, seed=2)},
                       SamplingParams(max_tokens=5, ignore_eos=True))
    finished = {}
    with caplog.at_level("WARNING", logger="runlm.engine"):
        for _ in range(400):
            finished |= {o.request_id: o for o in engine.step() if o.finished}
            if not engine.has_unfinished_requests():
                break
    assert set(finished) == {"long", "short"}, "the engine stalled"
    long = finished["long"].outputs[0]
    assert long.finish_reason == "length" and 8 + len(long.token_ids) <= 40
    assert finished["short"].outputs[0].finish_reason == "length"
    assert len(finished["short"].outputs[0].token_ids) == 5
    assert "KV cache" in caplog.text
    assert engine.blocks.num_free_blocks == len(engine.blocks.blocks)


def test_prompt_logprobs_are_computed_once_per_request_not_per_n(llm: LLM) -> None:
    """Issue 15 #11: each of n completions computed them (and skipped the prefix cache to do so)."""
    engine = llm.engine
    llm.reset_prefix_cache()
    prompt = {"prompt_token_ids": prompt_ids(40, seed=9)}
    one = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3, ignore_eos=True))[0]
    llm.reset_prefix_cache()
    engine.add_request("n4", prompt, SamplingParams(n=4, max_tokens=2, prompt_logprobs=3, ignore_eos=True, seed=1))
    seqs = list(engine.requests["n4"].seqs)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(seqs[0].prompt_logprobs) == 40
    assert all(s.prompt_logprobs is None for s in seqs[1:])
    assert outs[0].prompt_logprobs == one.prompt_logprobs and len(outs[0].outputs) == 4
    assert engine.blocks.stats.hits > 0  # the other three took the prompt from the prefix cache
