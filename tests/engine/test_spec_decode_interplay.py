"""Speculative decoding alongside everything else the engine does (issue 13): preemption when the KV cache
runs out, the prefix cache, chunked prefill, n > 1, stop strings, logprobs, structured outputs (the grammar
masks every verified position) and abort. Each run with a draft must give the plain run's outputs."""
from __future__ import annotations

from runlm.engine.llm import LLM
from runlm.engine.types.outputs import RequestOutput
from runlm.engine.types.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids
from tests.fixtures.near_copy import near_copy

SHARED = prompt_ids(12, seed=99)  # a common prefix: later prompts find it in the prefix cache
PROMPTS = [{"prompt_token_ids": SHARED + prompt_ids(n, seed=n)} for n in (3, 18, 25, 9)]
BLOCKS = 24  # about two sequences' worth of 4-token blocks: six sequences at once must preempt


def _engine(target: str, draft: str | None) -> LLM:
    per_token = 512 * (2 if draft else 1)  # the tiny qwen2's K/V bytes per token, and the draft's alike
    spec = None if draft is None else {"model": draft, "num_speculative_tokens": 3, "min_acceptance_rate": 0}
    return LLM(target, block_size=4, max_num_batched_tokens=16, kv_cache_memory=BLOCKS * 4 * per_token,
               speculative_config=spec)


def _summary(outs: list[RequestOutput]) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]


def test_outputs_are_unchanged_under_preemption_stops_grammar_and_n(tiny_model) -> None:
    target = str(tiny_model("qwen2"))
    plain = _engine(target, None)
    free = plain.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    stop = free[0].outputs[0].text[12:18]  # a stop string the greedy text reaches in the middle
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2, logprobs=2),
              SamplingParams(temperature=0, max_tokens=16, structured_outputs={"regex": "[a-z]{2,5}( [a-z]{2,5})+"}),
              SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=7, min_tokens=5)]
    plain.reset_prefix_cache()
    want = plain.generate(PROMPTS, params)
    assert want[0].outputs[0].finish_reason == "stop" and want[0].outputs[0].stop_reason == stop
    for draft in (str(near_copy("qwen2", 0.01)),):
        llm = _engine(target, draft)
        got = llm.generate(PROMPTS, params)
        # the seeded sampled request keeps its distribution, not its tokens: compare the greedy ones
        assert _summary(got[:3]) == _summary(want[:3])
        assert len(got[3].outputs[0].token_ids) == 16
        assert llm.engine.num_preemptions > 0
        assert llm.engine.blocks.stats.hits > 0
        assert llm.engine.spec is not None and llm.engine.spec.stats.num_accepted_tokens > 10
        assert llm.engine.blocks.num_free_blocks == BLOCKS  # every block came back, rolled-back ones included


def test_abort_in_the_middle_of_speculation_frees_everything(tiny_model) -> None:
    target = str(tiny_model("qwen2"))
    llm = _engine(target, target)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, params)
    assert engine.spec is not None
    for _ in range(20):  # the draft's catching up shares the step budget with the prefills: drafts come after them
        engine.step()
        if engine.spec.stats.num_drafts > 2:
            break
    assert engine.spec.stats.num_drafts > 2 and "1" in engine.requests
    (out,) = engine.abort_request("1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    want = _engine(target, None).generate([PROMPTS[0], PROMPTS[2]], params)
    assert [done["0"].outputs[0].token_ids, done["2"].outputs[0].token_ids] == [w.outputs[0].token_ids for w in want]
    assert engine.blocks.num_free_blocks == BLOCKS
