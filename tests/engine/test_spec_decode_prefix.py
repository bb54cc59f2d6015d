"""A draft model's prompt work (issue 13): blocks found in the prefix cache that hold the draft's K/V too are
not recomputed by the draft, blocks that do not are, and the draft's catching up shares the step's token
budget with the target. Greedy output stays the plain run's throughout."""
from __future__ import annotations

import pytest

from runlm.engine.core.scheduler import SchedulerOutput
from runlm.engine.llm import LLM
from runlm.engine.spec_decode.draft import DraftModelProposer
from runlm.engine.types.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids
from tests.fixtures.near_copy import near_copy

PROMPT = {"prompt_token_ids": prompt_ids(61, seed=61)}  # 15 whole 4-token blocks, then one token
CACHED = 60  # what the prefix cache can give back (never the last token)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(block_size=4, max_num_batched_tokens=24, kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def pair(tiny_model) -> tuple[str, str, list[int]]:
    target = str(tiny_model("qwen2"))
    want = LLM(target, **ENGINE).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    return target, str(near_copy("qwen2", 0.01)), want


def _spec(target: str, draft: str) -> tuple[LLM, DraftModelProposer]:
    llm = LLM(target, **ENGINE, speculative_config={"model": draft, "num_speculative_tokens": 3,
                                                    "min_acceptance_rate": 0})
    assert llm.engine.spec is not None and llm.engine.spec.draft is not None
    return llm, llm.engine.spec.draft


def _run(llm: LLM, draft: DraftModelProposer, params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    """The output, and how many tokens the draft caught up on after the step that computed the prompt."""
    engine = llm.engine
    engine.add_request("r", PROMPT, params)
    before = draft.num_catch_up_tokens
    while engine.scheduler.waiting or any(s.num_computed_tokens < len(PROMPT["prompt_token_ids"])
                                          for s in engine.scheduler.running):
        engine.step()
    first = draft.num_catch_up_tokens - before
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids, first
    raise AssertionError("the request did not finish")


def test_a_prefix_cache_hit_spares_the_draft_the_cached_blocks(pair) -> None:
    target, near, want = pair
    llm, draft = _spec(target, near)
    first, _ = _run(llm, draft)
    second, work = _run(llm, draft)
    assert first == second == want
    assert llm.engine.blocks.stats.hits == CACHED
    assert work == 61 + 1 - CACHED  # the draft starts after the cached blocks (and takes the new token too)


def test_blocks_the_draft_never_computed_are_computed_on_a_hit(pair) -> None:
    """A request that never reached drafting leaves blocks with the target's K/V only: a later hit on them must not
    trust the draft's slots there (they hold nothing, or another sequence's K/V)."""
    target, near, want = pair
    llm, draft = _spec(target, near)
    before = draft.num_catch_up_tokens
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))
    assert draft.num_catch_up_tokens == before  # one token, no decoding: the draft never ran
    got, work = _run(llm, draft)
    assert got == want and llm.engine.blocks.stats.hits == CACHED
    # from position 0, as far as the step's budget goes (the target computed one token of it)
    assert work == ENGINE["max_num_batched_tokens"] - 1
    assert llm.engine.spec is not None and llm.engine.spec.stats.acceptance_rate > 0.2


def test_the_drafts_catching_up_counts_in_the_step_budget(pair, monkeypatch) -> None:
    target, near, want = pair
    llm, draft = _spec(target, near)
    engine = llm.engine
    scheduled: list[int] = []
    schedule = engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        out = schedule()
        scheduled.append(out.total_tokens)
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", spy)
    prompts = [PROMPT, {"prompt_token_ids": prompt_ids(40, seed=3)}]
    engine.add_request("a", prompts[0], GREEDY)
    engine.add_request("b", prompts[1], GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        before = draft.num_catch_up_tokens
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert scheduled[-1] + draft.num_catch_up_tokens - before <= ENGINE["max_num_batched_tokens"]
    assert outs["a"].outputs[0].token_ids == want
    assert engine.spec is not None and engine.spec.stats.num_accepted_tokens > 5
    assert engine.blocks.num_free_blocks == len(engine.blocks.blocks)
