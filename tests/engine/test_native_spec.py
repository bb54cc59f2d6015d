"""Speculative decoding on the native runner (issue 30): the k + 1 verification rows ride in the same native step
as every other row, so greedy output is token for token and logprob for logprob the output without speculation,
with n-gram lookup and with a draft model, which runs natively too (numpy K/V over the target's block tables)
where it can, and on torch beside the native target where it cannot. Nothing imports torch on the native path."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import pytest

from runlm.engine.core.spec_state import SpecState
from runlm.engine.llm import LLM
from runlm.engine.spec_decode.decoder import break_even_rate
from runlm.engine.spec_decode.ngram import NgramProposer
from runlm.engine.types.outputs import RequestOutput
from runlm.engine.types.sampling_params import SamplingParams
from runlm.native import kernels
from tests.engine.conftest import prompt_ids
from tests.fixtures.gguf_convert import converted_gguf
from tests.fixtures.near_copy import near_copy, near_copy_gguf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")

# a small step budget, so drafts compete with prefill chunks for room and are cut short
ENGINE = dict(block_size=4, max_num_batched_tokens=24, kv_cache_memory="64MiB")
PROMPTS = [{"prompt_token_ids": prompt_ids(n, seed=n, vocab=32000)} for n in (5, 30, 61)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)


def _same(want: list[RequestOutput], got: list[RequestOutput]) -> None:
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs  # the same rows' floats: batch-invariant kernels


@pytest.fixture(scope="module")
def llama_q8() -> tuple[str, list[RequestOutput]]:
    target = str(converted_gguf("llama", "q8_0"))
    return target, LLM(target, **ENGINE).generate(PROMPTS, GREEDY)


def test_smollm2_ngram_speculation_changes_nothing(smollm2_gguf) -> None:
    """A quote (lookup drafts most tokens) and a story (drafts mostly rejected) in one batch: the same output."""
    passage = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
               "the ninety steps and wound the clockwork that turned the great lens.")
    kw = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory="64MiB")
    plain = LLM(str(smollm2_gguf), **kw)
    quote = {"prompt_token_ids": plain.encode_chat(
        [{"role": "user", "content": f"Quote the following passage word for word, then stop.\n\n{passage}"}])}
    story = {"prompt_token_ids": plain.encode_chat([{"role": "user", "content": "Tell me a story."}])}
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
    want = plain.generate([quote, story], params)
    llm = LLM(str(smollm2_gguf), **kw, speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert plain.engine.native and llm.engine.native
    _same(want, llm.generate([quote, story], params))
    assert llm.engine.spec is not None and llm.engine.spec.stats.acceptance_rate > 0.5


@pytest.mark.parametrize("draft,native_draft,accepted", [
    pytest.param("near-copy-gguf", True, "some", id="native-draft"),
    pytest.param("target", True, "all", id="target-as-draft", marks=pytest.mark.slow),
    pytest.param("near-copy-safetensors", False, "some", id="torch-draft", marks=pytest.mark.slow),
])
def test_a_draft_model_changes_nothing(llama_q8, draft: str, native_draft: bool, accepted: str) -> None:
    target, want = llama_q8
    path = {"near-copy-gguf": lambda: near_copy_gguf("llama", 0.01), "target": lambda: target,
            "near-copy-safetensors": lambda: near_copy("llama", 0.01)}[draft]()
    llm = LLM(target, **ENGINE, speculative_config={"model": str(path), "num_speculative_tokens": 4,
                                                    "min_acceptance_rate": 0})
    spec = llm.engine.spec
    assert llm.engine.native and spec is not None and spec.draft is not None and spec.draft.native == native_draft
    got = llm.generate(PROMPTS, GREEDY)
    _same(want, got)
    rate = spec.stats.acceptance_rate
    assert spec.stats.num_draft_tokens > 24 and (rate == 1.0 if accepted == "all" else 0.2 < rate < 0.99), rate
    assert sum(o.metrics.num_accepted_tokens for o in got if o.metrics) == spec.stats.num_accepted_tokens


def test_sleep_and_wake_up_keep_the_native_draft(llama_q8) -> None:
    target, want = llama_q8
    llm = LLM(target, **ENGINE, speculative_config={"model": str(near_copy_gguf("llama", 0.01)),
                                                    "num_speculative_tokens": 3})
    spec = llm.engine.spec
    assert spec is not None and spec.draft is not None and spec.draft.native
    llm.engine.sleep(2)
    assert spec.draft.runner.kv_caches == []
    llm.engine.wake_up()
    _same(want[:1], llm.generate(PROMPTS[:1], GREEDY))
    assert spec.stats.num_accepted_tokens > 0


def test_native_speculation_never_imports_torch(smollm2_gguf, llama_q8) -> None:
    target, _ = llama_q8
    draft = near_copy_gguf("llama", 0.01)  # built here: making it needs torch
    code = textwrap.dedent(f"""
        import json, sys
        from runlm.engine.llm import LLM
        from runlm.engine.types.sampling_params import SamplingParams
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        done = {{}}
        for name, path, spec in [("ngram", {str(smollm2_gguf)!r}, {{"method": "ngram"}}),
                                 ("draft", {target!r}, {{"model": {str(draft)!r}}})]:
            llm = LLM(path, max_model_len=256, kv_cache_memory="32MiB", speculative_config=spec)
            llm.generate(["1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2"], params, use_tqdm=False)
            done[name] = [llm.engine.native, llm.engine.spec.stats.num_drafts > 0]
        print(json.dumps({{"runs": done, "torch": "torch" in sys.modules}}))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"runs": {"ngram": [True, True], "draft": [True, True]},
                                                               "torch": False}


def _lookup(ids: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Prompt lookup as its definition says it, by brute force: the longest suffix (hi down to lo) found earlier,
    its latest occurrence with k tokens after it, else its first."""
    for n in range(min(hi, len(ids) - 1), lo - 1, -1):
        starts = [s for s in range(len(ids) - n) if ids[s:s + n] == ids[-n:]]
        if starts:
            full = [s for s in starts if s + n + k <= len(ids)]
            s = full[-1] if full else starts[0]
            return ids[s + n:s + n + k]
    return []


def test_ngram_lookup_is_the_brute_force_definition() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        ids = [rng.randrange(rng.randint(1, 4)) for _ in range(rng.randint(0, 30))]
        k = rng.randint(0, 6)
        assert NgramProposer(lo, hi).propose(ids, k) == (_lookup(ids, k, lo, hi) if k and len(ids) > lo else [])


def test_a_draft_shrinks_after_rejections_and_grows_back() -> None:
    state = SpecState()
    assert state.draft_length(5) == 5  # no verification yet: the whole k
    lengths = []
    for accepted in (0, 0, 1, 2, 3):
        state.record(5, accepted, min_rate=0.0, warmup=2)
        lengths.append(state.draft_length(5))
    assert lengths == [1, 1, 3, 5, 5]
    state.record(4, 0, min_rate=0.5, warmup=1)  # paused: it starts over with the whole k
    assert state.paused_steps > 0 and state.draft_length(5) == 5


def test_the_break_even_rate_rises_with_the_batch() -> None:
    """A verification row is dear beside one sequence's step and cheap beside a big batch's fixed cost."""
    rates = [break_even_rate(b, 0.1) for b in (1, 2, 8, 32)]
    assert rates == sorted(rates) and 0.1 < rates[0] < 0.25 and 0.5 < rates[2] < 0.75 and rates[3] < 1.0
    assert break_even_rate(1, 0.5) == 0.5 and break_even_rate(8, 0.0) == 0.0  # 0: the cost controls off
