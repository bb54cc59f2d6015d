"""The GPU runner's device sampler (runlm.engine.runners.gpu_sampler) against the numpy sampler, on the CPU: the
same tokens, kept sets, penalties and logprobs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runlm.engine.core.sequence import Sequence
from runlm.engine.runners import gpu_sampler
from runlm.engine.sample import sampler as np_sampler
from runlm.engine.sample.sampler import make_generator
from runlm.engine.types.sampling_params import SamplingParams

VOCAB = 300


def _seqs(params: list[SamplingParams], seed: int = 0) -> list[Sequence]:
    rng = np.random.default_rng(seed)
    out = []
    for i, p in enumerate(params):
        prompt = rng.integers(0, VOCAB, 12).tolist()
        output = rng.integers(0, VOCAB, 6).tolist()
        out.append(Sequence("r", i, prompt + output, len(prompt), p, generator=make_generator(p.seed)))
    return out


def _logits(rows: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, VOCAB)) * 3).astype(np.float32)


def test_greedy_equals_the_numpy_sampler() -> None:
    params = [SamplingParams(temperature=0.0) for _ in range(8)]
    raw = _logits(8)
    want = [t.token for t in np_sampler.sample_batch(raw, _seqs(params), None)]
    got = [t.token for t in gpu_sampler.sample_on_device(torch.from_numpy(raw), _seqs(params), None)]
    assert got == want


@pytest.mark.parametrize("knobs", [dict(top_k=7), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=20, top_p=0.8, min_p=0.05),
                                   dict(temperature=0.5), dict(top_n_sigma=1.0), dict(typical_p=0.5),
                                   dict(top_n_sigma=2.0, typical_p=0.9, top_k=40, min_p=0.01)])
def test_kept_sets_equal_the_numpy_sampler(knobs: dict) -> None:
    raw = _logits(6, seed=3)
    p = SamplingParams(temperature=knobs.pop("temperature", 1.0), **knobs)
    ones = torch.ones(6)
    got = gpu_sampler.probabilities(torch.from_numpy(raw), ones * p.temperature, (ones * p.top_k).long(),
                                    ones * p.top_p, ones * p.min_p, p.top_k, p.top_p < 1.0,
                                    ones * p.top_n_sigma if p.top_n_sigma > 0 else None,
                                    ones * p.typical_p if p.typical_p < 1.0 else None).numpy()
    for i in range(6):
        want = np_sampler.probabilities(raw[i], p)
        assert np.array_equal(np.flatnonzero(got[i]), np.flatnonzero(want))
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-7)


def test_mixed_rows_sample_the_numpy_tokens_with_the_same_seeds() -> None:
    """One uniform per row from the sequence's own generator: the device draws what numpy draws."""
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.3, top_k=30, seed=2), SamplingParams(temperature=0.7, min_p=0.1, seed=3)]
    for step in range(5):
        raw = _logits(4, seed=10 + step)
        a, b = _seqs(params), _seqs(params)
        for _ in range(step):  # the generators' streams advanced as after `step` steps
            for s, t in zip(a, b):
                if s.generator is not None and t.generator is not None:
                    s.generator.random()
                    t.generator.random()
        want = [t.token for t in np_sampler.sample_batch(raw, a, None)]
        assert [t.token for t in gpu_sampler.sample_on_device(torch.from_numpy(raw), b, None)] == want


def test_seeded_sampling_is_reproducible_whatever_the_batch() -> None:
    p = SamplingParams(temperature=1.0, seed=42)
    raw = _logits(3, seed=5)
    alone = gpu_sampler.sample_on_device(torch.from_numpy(raw[:1]), _seqs([p]), None)[0].token
    mixed = _seqs([p, SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, seed=9)])
    assert gpu_sampler.sample_on_device(torch.from_numpy(raw), mixed, None)[0].token == alone


def test_penalties_equal_the_numpy_sampler() -> None:
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.7, frequency_penalty=0.4),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5), SamplingParams()]
    raw = _logits(4, seed=7)
    seqs = _seqs(params)
    want = np_sampler.process_logits(raw, params, [s.token_ids[:s.num_prompt_tokens] for s in seqs],
                                     [s.output_token_ids for s in seqs], [s.stop_ids for s in seqs])
    got = gpu_sampler.apply_penalties(torch.from_numpy(raw), params, [s.token_ids[:s.num_prompt_tokens] for s in seqs],
                                      [s.output_token_ids for s in seqs])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0) for _ in range(4)]
    assert [t.token for t in gpu_sampler.sample_on_device(torch.from_numpy(raw), _seqs(greedy), None)] == \
        [t.token for t in np_sampler.sample_batch(raw, _seqs(greedy), None)]


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_equal_the_numpy_sampler(mode: str) -> None:
    params = [SamplingParams(temperature=0.0, logprobs=3, logprobs_mode=mode),
              SamplingParams(temperature=0.8, seed=4, logprobs=0, logprobs_mode=mode, repetition_penalty=1.2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5, logprobs=5, logprobs_mode=mode)]
    raw = _logits(4, seed=11)
    want = np_sampler.sample_batch(raw, _seqs(params), None)
    got = gpu_sampler.sample_on_device(torch.from_numpy(raw), _seqs(params), None)
    for w, g in zip(want, got):
        assert g.token == w.token
        if w.logprobs is None:
            assert g.logprobs is None
            continue
        assert g.logprobs is not None and list(g.logprobs) == list(w.logprobs)
        for tid, lp in w.logprobs.items():
            assert g.logprobs[tid].rank == lp.rank
            assert abs(g.logprobs[tid].logprob - lp.logprob) < 1e-5


def test_what_it_cannot_do_goes_to_the_numpy_sampler_by_name(caplog) -> None:
    params = [SamplingParams(temperature=0.0, logit_bias={5: 100.0}), SamplingParams(temperature=0.0)]
    seqs = _seqs(params)
    assert gpu_sampler.fallback_reason(seqs, None) == "logit_bias"
    assert gpu_sampler.fallback_reason(_seqs([SamplingParams(dry_multiplier=0.8)]), None) == "DRY"
    raw = _logits(2)
    assert gpu_sampler.sample_on_device(torch.from_numpy(raw), seqs, None)[0].token == 5


def test_xtc_and_mirostat_run_on_the_device_with_the_numpy_tokens_and_targets() -> None:
    """XTC's coin and mirostat's mu are host state the device sampler keeps as numpy's does: over many steps, mixed
    with plain rows, the same tokens and the same running targets."""
    params = [SamplingParams(temperature=1.0, xtc_probability=0.7, xtc_threshold=0.05, seed=3),
              SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=4.0, seed=4),
              SamplingParams(temperature=0.8, mirostat=1, mirostat_tau=3.0, mirostat_eta=0.2, seed=5),
              SamplingParams(temperature=0.9, top_p=0.9, seed=6), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.6, seed=7)]  # (no coin > 0.5)
    assert gpu_sampler.fallback_reason(_seqs(params), None) is None
    a, b = _seqs(params), _seqs(params)
    for step in range(30):
        raw = _logits(len(params), seed=100 + step)
        want = [t.token for t in np_sampler.sample_batch(raw, a, None)]
        assert [t.token for t in gpu_sampler.sample_on_device(torch.from_numpy(raw), b, None)] == want, step
        for x, y in zip(a, b):
            assert (x.mirostat_mu is None) == (y.mirostat_mu is None)
            if x.mirostat_mu is not None:
                assert abs(x.mirostat_mu - y.mirostat_mu) < 1e-6  # (float32 softmaxes summed apart)


def test_mirostat_kept_sets_equal_the_numpy_truncation() -> None:
    raw = _logits(4, seed=21)
    for version in (1, 2):
        for mu in (1.0, 3.0, 8.0):
            probs = torch.softmax(torch.from_numpy(raw), dim=-1)
            kept = gpu_sampler.mirostat_kept(probs, torch.full((4,), mu, dtype=torch.float64),
                                             torch.full((4,), version)).numpy()
            for i in range(4):
                p = SamplingParams(mirostat=version, mirostat_tau=mu / 2)  # (mu starts at 2 * tau)
                seq = _seqs([p])[0]
                gen = np.random.default_rng(0)
                token = np_sampler.mirostat_draw(np_sampler.softmax(raw[i]), p, seq, gen)
                assert kept[i, token] > 0  # numpy's draw is inside the device's kept set
                size = np.count_nonzero(kept[i])
                assert size >= 1 and (version == 1 or np.all(kept[i][kept[i] > 0] >= 2.0 ** -mu - 1e-12)
                                      or size == 1)


def test_penalty_window_equals_the_numpy_sampler() -> None:
    params = [SamplingParams(repetition_penalty=1.5, penalty_last_n=4), SamplingParams(repetition_penalty=1.5,
                                                                                       penalty_last_n=0)]
    raw = _logits(2, seed=9)
    seqs = _seqs(params)
    want = np_sampler.process_logits(raw, params, [s.token_ids[:s.num_prompt_tokens] for s in seqs],
                                     [s.output_token_ids for s in seqs], [frozenset()] * 2)
    got = gpu_sampler.apply_penalties(torch.from_numpy(raw), params, [s.token_ids[:s.num_prompt_tokens] for s in seqs],
                                      [s.output_token_ids for s in seqs]).numpy()
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(want[1], raw[1])  # a window of 0 penalizes nothing
    changed = set(np.flatnonzero(want[0] != raw[0]).tolist())
    assert changed <= set(seqs[0].output_token_ids[-4:]) and changed
