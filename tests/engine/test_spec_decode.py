"""Speculative decoding (issue 13): the greedy output is the output without speculation, token for token
and logprob for logprob, whatever the draft (a close model, an unrelated one, the target itself, n-gram
lookup), in exact and fast numerics, with chunked prefill, small blocks and several sequences at once."""
from __future__ import annotations

from dataclasses import replace

import pytest

from runlm.engine.core.spec_state import SpecState
from runlm.engine.llm import LLM
from runlm.engine.spec_decode.ngram import NgramProposer
from runlm.engine.types.outputs import RequestOutput
from runlm.engine.types.sampling_params import SamplingParams
from runlm.engine.types.spec_config import SpeculativeConfig
from tests.engine.conftest import prompt_ids
from tests.fixtures.near_copy import near_copy

# a small step budget, so drafts compete with prefill chunks for room and are cut short
ENGINE = dict(block_size=4, max_num_batched_tokens=24, kv_cache_memory="64MiB")
PROMPTS = [{"prompt_token_ids": prompt_ids(n, seed=n)} for n in (5, 30, 61)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _same(want: list[RequestOutput], got: list[RequestOutput]) -> None:
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w.outputs, g.outputs, strict=True):
            assert b.token_ids == a.token_ids
            assert b.logprobs == a.logprobs


# every family the engine's decoders share (llama, qwen2, qwen3) in both numerics; one runs by default
FAMILY_CASES = [pytest.param(recipe, exact, id=f"{recipe}-{'exact' if exact else 'fast'}",
                             marks=() if (recipe, exact) == ("qwen2", False) else pytest.mark.slow)
                for recipe in ("llama", "qwen2", "qwen3") for exact in (True, False)]


@pytest.mark.parametrize("recipe,exact", FAMILY_CASES)
def test_greedy_output_is_unchanged_by_a_draft_model(recipe: str, exact: bool, tiny_model) -> None:
    target = str(tiny_model(recipe))
    params = replace(GREEDY, logprobs=2) if exact else GREEDY  # logprobs too, where they cost the least time
    want = LLM(target, exact_numerics=exact, **ENGINE).generate(PROMPTS, params)
    drafts = [(near_copy(recipe, 0.01), "some"), (target, "all")]
    if recipe == "llama":
        drafts.append((tiny_model("qwen2"), "few"))  # an unrelated model: nearly every draft token is rejected
    for draft, accepted in drafts:
        llm = LLM(target, exact_numerics=exact, **ENGINE,
                  speculative_config={"model": str(draft), "num_speculative_tokens": 4, "min_acceptance_rate": 0})
        got = llm.generate(PROMPTS, params)
        _same(want, got)
        assert llm.engine.spec is not None
        stats = llm.engine.spec.stats
        assert stats.num_draft_tokens > 24
        rate = stats.acceptance_rate
        assert {"some": 0.2 < rate < 0.95, "few": rate < 0.2, "all": rate == 1.0}[accepted], (draft, rate)
        assert sum(o.metrics.num_accepted_tokens for o in got if o.metrics) == stats.num_accepted_tokens


@pytest.mark.parametrize("exact", [pytest.param(True, id="exact", marks=pytest.mark.slow),
                                   pytest.param(False, id="fast")])
def test_smollm2_ngram_lookup_on_a_repetitive_prompt(exact: bool, smollm2_gguf) -> None:
    """A real model asked to repeat a passage: prompt lookup drafts most tokens, and nothing changes."""
    passage = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
               "the ninety steps and wound the clockwork that turned the great lens.")
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1)
    kw = dict(exact_numerics=exact, block_size=16, max_num_batched_tokens=64, kv_cache_memory="64MiB")
    plain = LLM(str(smollm2_gguf), **kw)
    prompt = {"prompt_token_ids": plain.encode_chat(
        [{"role": "user", "content": f"Quote the following passage word for word, then stop.\n\n{passage}"}])}
    want = plain.generate([prompt], params)
    llm = LLM(str(smollm2_gguf), **kw, speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    got = llm.generate([prompt], params)
    _same(want, got)
    assert llm.engine.spec is not None and llm.engine.spec.stats.acceptance_rate > 0.6


def test_ngram_proposer_takes_the_longest_suffix_match() -> None:
    ngram = NgramProposer(1, 3)
    assert ngram.propose([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3], 2) == [4, 9]  # the 3-gram 1 2 3 beats 2 3
    assert ngram.propose([7, 8, 9, 7, 8], 4) == [9, 7, 8]  # only three tokens follow the match
    assert ngram.propose([1, 2, 3, 4], 3) == []
    assert NgramProposer(2, 2).propose([5, 1, 9, 5, 1], 1) == [9]


@pytest.mark.parametrize("bad,message", [
    ({"method": "eagle"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "ngram", "model": "x"}, "takes no 'model'"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "min_acceptance_rate": 1.5}, "min_acceptance_rate"),
    ({"method": "ngram", "draft_tensor_parallel_size": 1}, "unknown key"),
])
def test_bad_configs_are_refused_by_name(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.coerce(bad)


def test_a_draft_with_another_vocabulary_is_refused_naming_both_sizes(tiny_model, tinycoder_gguf) -> None:
    with pytest.raises(ValueError, match=r"\(32000 tokens\).*\(49152 tokens\)"):
        LLM(str(tiny_model("llama")), **ENGINE, speculative_config={"model": str(tinycoder_gguf)})


def test_a_sequence_whose_drafts_fail_stops_speculating_and_retries_later() -> None:
    state = SpecState()
    for _ in range(3):
        state.record(4, 0, min_rate=0.3, warmup=4)
        assert state.may_speculate()
    state.record(4, 0, min_rate=0.3, warmup=4)  # the fourth failure in a row: below 0.3 now
    assert [state.may_speculate() for _ in range(65)] == [False] * 64 + [True]
    for _ in range(4):
        state.record(4, 0, min_rate=0.3, warmup=4)
    assert state.paused_steps == 128  # each pause twice the last
    good = SpecState()
    for _ in range(10):
        good.record(4, 3, min_rate=0.3, warmup=4)
    assert good.may_speculate() and good.paused_steps == 0


def test_an_unrelated_draft_is_dropped_after_a_few_steps(tiny_model) -> None:
    """A draft that is almost never right costs a handful of verifications, not one per token."""
    target = str(tiny_model("llama"))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = LLM(target, **ENGINE).generate(PROMPTS[:1], params)
    llm = LLM(target, **ENGINE, speculative_config={"model": str(tiny_model("qwen2")), "num_speculative_tokens": 3,
                                                    "min_acceptance_rate": 0.5})
    _same(want, llm.generate(PROMPTS[:1], params))
    assert llm.engine.spec is not None and 2 <= llm.engine.spec.stats.num_drafts <= 4


def test_sleep_drops_and_wake_up_restores_the_draft_too(tiny_model) -> None:
    target = str(tiny_model("qwen2"))
    llm = LLM(target, **ENGINE, speculative_config={"model": str(near_copy("qwen2", 0.01)),
                                                    "num_speculative_tokens": 3})
    before = llm.generate(PROMPTS[:1], GREEDY)
    spec = llm.engine.spec
    assert spec is not None and spec.draft is not None
    llm.engine.sleep(2)
    assert spec.draft.runner.kv_caches == []
    llm.engine.wake_up()
    _same(before, llm.generate(PROMPTS[:1], GREEDY))
    assert spec.stats.num_accepted_tokens > 0


def test_a_target_whose_window_layers_have_their_own_blocks_speculates_unchanged(tiny_model) -> None:
    """Gemma 3 (5 window layers : 1 global, runlm/engine/core/kv_groups.py): the draft reads the global group's
    blocks, rollback covers both groups, and greedy output is what the target alone writes."""
    from runlm.engine.core.kv_groups import HybridBlockManager

    target = str(tiny_model("gemma3"))
    want = LLM(target, **ENGINE).generate(PROMPTS, GREEDY)
    for spec in ({"model": target, "num_speculative_tokens": 3}, {"method": "ngram", "num_speculative_tokens": 3}):
        llm = LLM(target, **ENGINE, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == \
            [o.outputs[0].token_ids for o in want]
        assert isinstance(llm.engine.blocks, HybridBlockManager) and llm.engine.spec.stats.num_accepted_tokens > 0
        assert all(g.num_free_blocks == len(g.blocks) for g in llm.engine.blocks.groups)
