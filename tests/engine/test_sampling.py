"""Every SamplingParams field does what vLLM's does."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from runlm.engine.core.sequence import Sequence
from runlm.engine.llm import LLM
from runlm.engine.sample.sampler import (
    exclude_top_choices,
    make_generator,
    probabilities,
    process_logits,
    sample,
    softmax,
)
from runlm.engine.types.sampling_params import SamplingParams, SamplingParamsError
from runlm.models.attention import ForwardContext, forward_context
from tests.engine.conftest import prompt_ids

PROMPT = {"prompt_token_ids": prompt_ids(12, seed=42)}


def _one(llm: LLM, **kw):
    return llm.generate([PROMPT], SamplingParams(**kw))[0]


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    model = llm.engine.loaded.model
    with torch.inference_mode(), forward_context(ForwardContext.no_cache([len(ids)])):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def test_n_gives_n_different_samples_and_seed_reproduces(llm: LLM) -> None:
    out = _one(llm, n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    texts = [c.token_ids for c in out.outputs]
    assert len(texts) == 3 and len({tuple(t) for t in texts}) == 3
    again = _one(llm, n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    assert [c.token_ids for c in again.outputs] == texts
    other = _one(llm, n=3, temperature=1.0, seed=6, max_tokens=12, ignore_eos=True)
    assert [c.token_ids for c in other.outputs] != texts


def test_greedy_is_argmax_and_max_tokens_gives_length(llm: LLM) -> None:
    out = _one(llm, temperature=0.0, max_tokens=5, ignore_eos=True).outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.token_ids[0] == int(_logits(llm, PROMPT["prompt_token_ids"])[-1].argmax())


def test_top_k_1_and_tiny_top_p_equal_greedy(llm: LLM) -> None:
    greedy = _one(llm, temperature=0.0, max_tokens=8, ignore_eos=True).outputs[0].token_ids
    assert _one(llm, temperature=1.0, top_k=1, seed=1, max_tokens=8, ignore_eos=True).outputs[0].token_ids == greedy
    assert _one(llm, temperature=1.0, top_p=1e-6, seed=1, max_tokens=8, ignore_eos=True).outputs[0].token_ids == greedy
    assert _one(llm, temperature=1.0, min_p=1.0, seed=1, max_tokens=8, ignore_eos=True).outputs[0].token_ids == greedy


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    greedy = _one(llm, temperature=0.0, max_tokens=8, ignore_eos=True).outputs[0].token_ids
    stop_at = greedy[3]
    out = _one(llm, temperature=0.0, max_tokens=8, stop_token_ids=[stop_at]).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == greedy[:greedy.index(stop_at) + 1]
    # min_tokens masks stop tokens until enough were generated
    out = _one(llm, temperature=0.0, max_tokens=8, stop_token_ids=[greedy[0]], min_tokens=4).outputs[0]
    assert len(out.token_ids) >= 4 and greedy[0] not in out.token_ids[:4]


def test_stop_strings_across_token_boundaries(llm: LLM) -> None:
    full = _one(llm, temperature=0.0, max_tokens=16, ignore_eos=True).outputs[0]
    text = full.text
    # a stop string straddling tokens: the last char of token 2's text plus the first of token 3's
    tok = llm.get_tokenizer()
    upto2 = tok.decode(full.token_ids[:3], skip_special_tokens=True)
    stop = text[len(upto2) - 1:len(upto2) + 1]
    assert len(stop) == 2 and text.find(stop) == len(upto2) - 1
    out = _one(llm, temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.find(stop)]
    kept = _one(llm, temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop],
                include_stop_str_in_output=True).outputs[0]
    assert kept.text == text[:text.find(stop) + len(stop)]


def test_logprobs_are_top_k_of_log_softmax(llm: LLM) -> None:
    out = _one(llm, temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3).outputs[0]
    ref = torch.log_softmax(_logits(llm, PROMPT["prompt_token_ids"])[-1].float(), -1)
    first = out.logprobs[0]
    chosen = out.token_ids[0]
    assert first[chosen].rank == 1 and math.isclose(first[chosen].logprob, float(ref[chosen]), abs_tol=1e-4)
    top = torch.topk(ref, 3)
    assert set(first) == set(top.indices.tolist())
    assert len(out.logprobs) == 3
    assert math.isclose(out.cumulative_logprob, sum(out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)),
                        abs_tol=1e-4)


def test_prompt_logprobs(llm: LLM) -> None:
    ids = PROMPT["prompt_token_ids"]
    out = _one(llm, temperature=0.0, max_tokens=1, prompt_logprobs=2)
    ref = torch.log_softmax(_logits(llm, ids).float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert math.isclose(entry[ids[pos]].logprob, float(ref[pos - 1, ids[pos]]), abs_tol=1e-4)
        assert len(entry) in (2, 3)


def test_logit_bias_and_allowed_token_ids(llm: LLM) -> None:
    out = _one(llm, temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={777: 100.0}).outputs[0]
    assert out.token_ids == [777] * 4
    allowed = [100, 200, 300]
    out = _one(llm, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed).outputs[0]
    assert set(out.token_ids) <= set(allowed)


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0)
    out = process_logits(logits, [p], [[0]], [[1]], [frozenset()])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # seen tokens: positive / 2, negative * 2
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits, [p], [[3]], [[2, 2, 0]], [frozenset()])
    assert out.tolist() == [[2.0 - 0.75, -2.0, 1.0 - 1.0, 0.5]]  # prompt tokens are not penalised


def test_dry_penalises_what_would_extend_a_repeat_of_the_output_only() -> None:
    import numpy as np

    logits = np.zeros((1, 10), dtype=np.float32)
    p = SamplingParams(dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=2)
    # output 1 2 3 4 1 2 3: writing 4 next would repeat "1 2 3 4" (3 tokens matched before it)
    out = process_logits(logits, [p], [[5, 6, 7, 8]], [[1, 2, 3, 4, 1, 2, 3]], [frozenset()])
    assert out[0, 4] == np.float32(-0.8 * 2.0 ** (3 - 2)) and (np.delete(out[0], 4) == 0).all()
    # matches shorter than dry_allowed_length are free; the prompt is never looked at
    out = process_logits(logits, [p], [[1, 2, 3, 4, 1, 2, 3]], [[9, 2, 3]], [frozenset()])
    assert out is logits or (out == 0).all()
    short = process_logits(logits, [p], [[]], [[1, 2, 7, 1]], [frozenset()])
    assert (short == 0).all()  # "1" then "2": a 1-token match
    window = SamplingParams(dry_multiplier=0.8, dry_base=2.0, dry_penalty_last_n=4)
    assert (process_logits(logits, [window], [[]], [[1, 2, 3, 4, 1, 2, 3]], [frozenset()]) == 0).all()


def test_logprobs_mode_raw_is_the_models_and_processed_is_what_was_sampled(llm: LLM) -> None:
    bias = {5: 30.0}
    raw = _one(llm, temperature=0.0, max_tokens=1, logprobs=2, logit_bias=bias).outputs[0]
    processed = _one(llm, temperature=0.0, max_tokens=1, logprobs=2, logit_bias=bias,
                     logprobs_mode="processed_logprobs").outputs[0]
    assert raw.token_ids == processed.token_ids == [5]
    assert raw.logprobs[0][5].rank > 1  # the model's own distribution: the bias is not in it
    assert processed.logprobs[0][5].rank == 1 and processed.logprobs[0][5].logprob > -1e-3
    plain = _one(llm, temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1).outputs[0]
    assert all(lp[t].rank == 1 for lp, t in zip(plain.logprobs, plain.token_ids))  # greedy's pick is the top-1
    with pytest.raises(SamplingParamsError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="raw_logits")


def test_penalties_change_generation(llm: LLM) -> None:
    plain = _one(llm, temperature=0.0, max_tokens=30, ignore_eos=True).outputs[0].token_ids
    penal = _one(llm, temperature=0.0, max_tokens=30, ignore_eos=True, frequency_penalty=2.0).outputs[0].token_ids
    assert len(set(penal)) >= len(set(plain))


def test_skip_special_tokens(tiny_model) -> None:
    llm = LLM(str(tiny_model("llama")), kv_cache_memory="32MiB")
    tok = llm.get_tokenizer()
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)[0]
    params = dict(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={im_end: 100.0})
    shown = llm.generate([PROMPT], SamplingParams(skip_special_tokens=False, **params))[0].outputs[0].text
    hidden = llm.generate([PROMPT], SamplingParams(skip_special_tokens=True, **params))[0].outputs[0].text
    assert shown == "<|im_end|>" * 3 and hidden == ""


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_k", -5), ("min_p", 2.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1),
    ("logprobs", 50), ("prompt_logprobs", -1), ("n", 0), ("stop", [""]), ("stop_token_ids", [-1]),
    ("logit_bias", {5: 1000.0}), ("allowed_token_ids", []), ("seed", "x"),
])
def test_invalid_values_name_the_parameter(field: str, value) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and field in str(info.value)


def test_token_ids_outside_vocab_are_refused(llm: LLM) -> None:
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        _one(llm, stop_token_ids=[10**7])


def _probs(**kw) -> tuple[np.ndarray, np.ndarray]:
    logits = (np.random.default_rng(1).standard_normal(200) * 2.5).astype(np.float32)
    return logits, probabilities(logits, SamplingParams(**kw))


def test_top_n_sigma_keeps_the_logits_within_n_deviations_of_the_top() -> None:
    logits, probs = _probs(top_n_sigma=1.5)
    keep = logits >= logits.max() - 1.5 * logits.std(dtype=np.float64)
    assert np.array_equal(probs > 0, keep) and 1 < keep.sum() < 200
    # invariant to temperature, as llama.cpp's
    assert np.array_equal(_probs(top_n_sigma=1.5, temperature=0.3)[1] > 0, keep)


def test_typical_p_keeps_the_tokens_nearest_the_entropy_to_the_mass() -> None:
    logits, probs = _probs(typical_p=0.4)
    full = softmax(logits)
    entropy = -(full * np.log(full)).sum()
    order = np.argsort(np.abs(-np.log(full) - entropy), kind="stable")
    n = int(np.searchsorted(np.cumsum(full[order]), 0.4, side="right")) + 1
    assert set(np.flatnonzero(probs).tolist()) == set(order[:n].tolist())
    assert probs.sum() == pytest.approx(1.0, abs=1e-5)


def test_xtc_removes_every_top_choice_but_the_least_likely() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32)
    always = SamplingParams(xtc_probability=1.0, xtc_threshold=0.1)
    out = exclude_top_choices(probs, always, make_generator(0))
    assert out.tolist() == [0.0, 0.0, np.float32(0.15), np.float32(0.05)]
    # one token above the threshold: nothing to exclude; a threshold above 0.5 switches it off
    assert np.array_equal(exclude_top_choices(probs, SamplingParams(xtc_probability=1.0, xtc_threshold=0.4),
                                              make_generator(0)), probs)
    assert np.array_equal(exclude_top_choices(probs, SamplingParams(xtc_probability=1.0, xtc_threshold=0.6),
                                              make_generator(0)), probs)
    never = SamplingParams(xtc_probability=1e-9, xtc_threshold=0.1)
    assert np.array_equal(exclude_top_choices(probs, never, make_generator(0)), probs)


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_steers_the_surprise_toward_tau(version: int) -> None:
    """Over many draws the observed surprise (bits) averages near tau, whatever the distribution's own entropy."""
    rng = np.random.default_rng(0)
    logits = np.sort(rng.standard_normal(500).astype(np.float32) * 4)[::-1].copy()
    for tau in (1.0, 3.0):
        p = SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=tau, mirostat_eta=0.2, seed=1)
        seq = Sequence("r", 0, [1], 1, p, generator=make_generator(1))
        full = softmax(logits)
        seen = []
        for _ in range(400):
            tok = sample(logits[None], [p], [seq.generator], [seq])[0]
            seen.append(-np.log2(full[tok]))
        assert abs(np.mean(seen[100:]) - tau) < 0.6 * tau + 0.3, (tau, np.mean(seen[100:]))
        assert seq.mirostat_mu is not None


def test_penalty_last_n_limits_repetition_penalty_to_the_window() -> None:
    logits = np.zeros((1, 10), dtype=np.float32) + 1.0
    p = SamplingParams(repetition_penalty=2.0, penalty_last_n=2)
    out = process_logits(logits, [p], [[1, 2, 3]], [[4, 5]], [frozenset()])
    assert np.flatnonzero(out[0] != 1.0).tolist() == [4, 5]
    out = process_logits(logits, [SamplingParams(repetition_penalty=2.0, penalty_last_n=3)], [[1, 2, 3]], [[4, 5]],
                         [frozenset()])
    assert np.flatnonzero(out[0] != 1.0).tolist() == [3, 4, 5]


@pytest.mark.parametrize("field,value", [("typical_p", 0.0), ("top_n_sigma", -2.0), ("xtc_probability", 1.5),
                                         ("mirostat", 3), ("mirostat_tau", 0.0), ("penalty_last_n", -2)])
def test_llama_cpp_sampler_bounds_name_the_field(field: str, value) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
