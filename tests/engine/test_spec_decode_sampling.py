"""Rejection sampling keeps the target's distribution (issue 13): seeded draws through the verifier match the
target's probabilities, while the naive rule (keep every draft token) visibly does not; and through the
engine, sampled tokens with a draft model are distributed as without one."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from runlm.engine.llm import LLM
from runlm.engine.sample.rejection import _rejection_step
from runlm.engine.sample.sampler import draw, make_generator
from runlm.engine.types.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids
from tests.fixtures.near_copy import near_copy

DRAWS = 20_000
Z_999 = 3.0902  # the standard normal's 0.999 quantile
# p and a draft q that disagree: q puts most of its mass where p has little
P = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=np.float32)
Q = np.array([0.05, 0.10, 0.15, 0.20, 0.25, 0.25], dtype=np.float32)


def _chi2_999(df: int) -> float:
    """Chi-square's 0.999 quantile (Wilson-Hilferty; within 1% from 3 degrees of freedom up)."""
    h = 2 / (9 * df)
    return df * (1 - h + Z_999 * h ** 0.5) ** 3


def _matches(counts: Counter[int], p: np.ndarray) -> bool:
    """Total variation under 0.015 and Pearson's chi-square under its 0.999 quantile."""
    n = sum(counts.values())
    freq = np.array([counts[i] / n for i in range(len(p))])
    tv = 0.5 * float(np.abs(freq - p).sum())
    stat = float((((freq - p) * n) ** 2 / (p * n)).sum())
    return tv < 0.015 and stat < _chi2_999(len(p) - 1)


def _draws(q: np.ndarray | None, rule=_rejection_step) -> Counter[int]:
    g = make_generator(1234)
    counts: Counter[int] = Counter()
    for _ in range(DRAWS):
        proposed = draw(q, g) if q is not None else 4  # n-gram: always token 4
        counts[rule(P, proposed, q, g)[0]] += 1
    return counts


def test_draft_model_tokens_are_distributed_as_the_target() -> None:
    assert _matches(_draws(Q), P)


def test_ngram_tokens_are_distributed_as_the_target() -> None:
    assert _matches(_draws(None), P)


def test_the_check_catches_a_sampler_that_keeps_every_draft() -> None:
    assert not _matches(_draws(Q, rule=lambda p, d, q, g: (d, True)), P)


@pytest.mark.slow
def test_engine_samples_match_with_and_without_a_draft(tiny_model) -> None:
    """Seeded requests at temperature 1 (top-k 3): the second and third tokens, which the draft proposes and
    the target verifies, have the same histogram with a draft as without (two-sample chi-square at 0.999)."""
    target = str(tiny_model("qwen2"))
    prompt = {"prompt_token_ids": prompt_ids(8, seed=3)}
    n = 200
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True, seed=i) for i in range(n)]
    kw = dict(block_size=4, max_num_batched_tokens=256, kv_cache_memory="64MiB")
    plain = LLM(target, **kw).generate([prompt] * n, params, use_tqdm=False)
    llm = LLM(target, **kw, speculative_config={"model": str(near_copy("qwen2", 0.05)), "num_speculative_tokens": 2,
                                                "min_acceptance_rate": 0})
    spec = llm.generate([prompt] * n, params, use_tqdm=False)
    assert llm.engine.spec is not None and llm.engine.spec.stats.num_accepted_tokens > 20
    assert_same_histograms(plain, spec)


def assert_same_histograms(plain: list, spec: list, positions: tuple[int, ...] = (1, 2)) -> None:
    """The output tokens at each of ``positions`` have the same histogram in both runs (two-sample chi-square at
    0.999; rare tokens lumped together, as chi-square needs)."""
    for pos in positions:
        a = Counter(o.outputs[0].token_ids[pos] for o in plain)
        b = Counter(o.outputs[0].token_ids[pos] for o in spec)
        rare = [c for c in set(a) | set(b) if a[c] + b[c] < 10]
        for counts in (a, b):
            counts[-1] = sum(counts.pop(c, 0) for c in rare)
        cells = sorted(c for c in set(a) | set(b) if a[c] + b[c])
        assert len(cells) >= 3
        # Pearson's two-sample statistic over the cells (equal sample sizes)
        stat = sum((a[c] - b[c]) ** 2 / (a[c] + b[c]) for c in cells)
        assert stat < _chi2_999(len(cells) - 1), (pos, a, b)
