"""Token masks in the engine loop: constrained rows obey their grammar, other rows are untouched,
and batching, preemption and seeds change nothing (a tiny random-weight model: any output the
grammar allows is possible, so only the grammar keeps it in line)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from runlm.engine.llm import LLM
from runlm.engine.structured.backend import bitmask_bias
from runlm.engine.types.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids

DIGITS = {"regex": r"[0-9]{20}"}  # SmolLM2's vocabulary spells digits one token each: exactly 20 tokens
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["size", "ok"],
          "properties": {"size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": -5, "maximum": 5}}}


def _prompts(n: int, seed: int = 0) -> list[dict]:
    return [{"prompt_token_ids": prompt_ids(6 + 3 * i, seed=seed + i)} for i in range(n)]


def _texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


def test_bitmask_bias_reads_bit_j_of_word_w_as_token_32w_plus_j() -> None:
    allowed = torch.rand(3, 128) < 0.3
    allowed[0, 31] = allowed[1, 127] = True  # sign bits
    words = torch.zeros(3, 4, dtype=torch.int64)
    for b, t in allowed.nonzero().tolist():
        words[b, t // 32] |= 1 << (t % 32)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).numpy()
    assert torch.equal(torch.from_numpy(bitmask_bias(packed)), torch.where(allowed, 0.0, float("-inf")))


@pytest.mark.parametrize("so, check", [
    (DIGITS, lambda t: re.fullmatch(r"[0-9]{20}", t)),
    ({"regex": r"(\+1 )?\(\d{3}\) \d{3}-\d{4}"}, lambda t: re.fullmatch(r"(\+1 )?\(\d{3}\) \d{3}-\d{4}", t)),
    ({"choice": ["red", "green", "dark blue"]}, lambda t: t in ("red", "green", "dark blue")),
    ({"grammar": 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]'}, lambda t: re.fullmatch(r"\([a-c](,[a-c])*\)", t)),
    ({"json": SCHEMA}, lambda t: json.loads(t)["size"] in "SML"),
])
def test_sampled_output_matches_its_constraint(llm: LLM, so, check) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs=so)
    for out in llm.generate(_prompts(4), params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_unconstrained_rows_are_untouched_in_a_mixed_batch(llm: LLM) -> None:
    free = SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    prompts = _prompts(3, seed=50)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    constrained = SamplingParams(temperature=1.0, seed=5, max_tokens=30, structured_outputs=DIGITS)
    mixed = llm.generate(prompts + _prompts(3, seed=90), [free] * 3 + [constrained] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    assert all(re.fullmatch(r"[0-9]{20}", t) for t in _texts(mixed[3:]))
    assert not llm.engine.structured.seqs  # every matcher is dropped when its sequence ends


def test_constrained_output_is_the_same_after_preemption(tiny_model) -> None:
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=30, structured_outputs=DIGITS)
    prompts = [{"prompt_token_ids": prompt_ids(24 + i, seed=10 + i)} for i in range(6)]
    roomy = LLM(str(tiny_model("qwen2")), block_size=4, kv_cache_memory="64MiB")
    # 6 x (about 45 tokens) need about 70 blocks of 4; 30 forces preemptions mid-grammar
    tight = LLM(str(tiny_model("qwen2")), block_size=4, kv_cache_memory=30 * 4 * roomy.engine.kv_bytes_per_token)
    expected = _texts(roomy.generate(prompts, params, use_tqdm=False))
    assert all(re.fullmatch(r"[0-9]{20}", t) for t in expected)
    assert _texts(tight.generate(prompts, params, use_tqdm=False)) == expected
    assert tight.engine.num_preemptions > 0


def test_n_samples_each_follow_the_grammar_and_length_cuts_short(llm: LLM) -> None:
    out = llm.generate(_prompts(1), SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=30,
                                                   structured_outputs=DIGITS), use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) == 3 and all(re.fullmatch(r"[0-9]{20}", t) for t in texts)
    short = llm.generate(_prompts(1), SamplingParams(max_tokens=5, structured_outputs=DIGITS), use_tqdm=False)[0]
    assert short.outputs[0].finish_reason == "length" and re.fullmatch(r"[0-9]{5}", short.outputs[0].text)


def test_grammar_wins_over_min_tokens_when_only_the_end_is_allowed(llm: LLM) -> None:
    out = llm.generate(_prompts(1), SamplingParams(min_tokens=10, max_tokens=20, structured_outputs={
        "choice": ["yes"]}), use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("yes")
