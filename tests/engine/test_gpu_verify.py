"""Speculative decoding verified on the GPU runner's device (runlm/engine/runners/gpu_verify.py): for greedy and
seeded sampled requests, n-gram and draft-model drafts, the tokens and the generators' streams equal the host
verifier's (runlm.engine.sample.rejection.verify_draft); requests whose rows depend on earlier accepted tokens go to
the host's verifier by name; end to end, a seeded sampled request speculating on the GPU runner (on the CPU) gives
the torch runner's tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runlm.engine.core.sequence import Sequence
from runlm.engine.runners.gpu_verify import host_reason, sample_and_verify_on_device
from runlm.engine.sample.rejection import sample_and_verify
from runlm.engine.sample.sampler import make_generator
from runlm.engine.types.sampling_params import SamplingParams

VOCAB = 40


def _seq(params: SamplingParams, seed: int | None, draft: list[int], probs: np.ndarray | None,
         stops: frozenset[int] = frozenset()) -> Sequence:
    seq = Sequence("r", 0, [1, 2, 3], 3, params, 0, 0.0, generator=make_generator(seed), stop_ids=stops)
    seq.spec.tokens, seq.spec.probs = list(draft), probs
    return seq


def _case(rng: np.random.Generator, k: int, model_draft: bool) -> tuple[np.ndarray, list[int], np.ndarray | None]:
    """Logits for 1 + k rows, and a draft: tokens the target likes (so some stand) or drawn from a draft model's q."""
    logits = (rng.standard_normal((k + 1, VOCAB)) * 2.5).astype(np.float32)
    if not model_draft:
        likely = logits.argsort(axis=-1)[:, ::-1][:k]
        return logits, [int(row[rng.integers(0, 3)]) for row in likely], None
    q = np.exp(logits[:k] + rng.standard_normal((k, VOCAB)).astype(np.float32))
    q = (q / q.sum(axis=-1, keepdims=True)).astype(np.float32)
    return logits, [int(rng.choice(VOCAB, p=row / row.sum())) for row in q], q


PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "plain": SamplingParams(temperature=1.0),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=12, top_p=0.9),
    "min_p": SamplingParams(temperature=1.3, min_p=0.05),
}


@pytest.mark.parametrize("model_draft", [False, True], ids=["ngram", "draft_model"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_the_device_verifier_gives_the_host_verifiers_tokens_and_streams(name, model_draft):
    rng = np.random.default_rng(7)
    outcomes = set()
    for trial in range(40):
        k = int(rng.integers(1, 6))
        logits, draft, q = _case(rng, k, model_draft)
        stops = frozenset({int(draft[-1])}) if trial % 7 == 0 else frozenset()  # (an accepted stop ends the walk)
        params = PARAMS[name]
        host_seq, dev_seq = (_seq(params, 100 + trial, draft, q, stops) for _ in range(2))
        assert host_reason(dev_seq, None) is None
        plain = rng.standard_normal((1, VOCAB)).astype(np.float32)  # a plain sampled row before it, as in a step
        plain_host, plain_dev = (_seq(params, 5, [], None) for _ in range(2))
        want = sample_and_verify(np.concatenate([plain, logits]), [plain_host], [host_seq], None)
        got = sample_and_verify_on_device(torch.from_numpy(np.concatenate([plain, logits])), [plain_dev], [dev_seq],
                                          None)
        assert [(r.seq is dev_seq, r.token) for r in got] == [(r.seq is host_seq, r.token) for r in want], trial
        if not params.greedy:  # each generator moved on by the same number of draws
            assert dev_seq.generator.random() == host_seq.generator.random()
            assert plain_dev.generator.random() == plain_host.generator.random()
        outcomes.add(len(want) - 1)
    assert len(outcomes) > 1  # (the cases reach both rejections and acceptances)


def test_rows_that_depend_on_accepted_tokens_are_verified_on_the_host():
    draft = [3, 4]
    cases = {
        "penalty": (SamplingParams(temperature=0.7, repetition_penalty=1.2), None),
        "min_tokens": (SamplingParams(temperature=0.7, min_tokens=2), None),
        "logprobs": (SamplingParams(temperature=0.0, logprobs=2), "logprobs"),
        "mirostat": (SamplingParams(temperature=0.7, mirostat=2), "mirostat or XTC"),
    }
    for name, (params, reason) in cases.items():
        seq = _seq(params, 1, draft, None, stops=frozenset({2}))
        got = host_reason(seq, None)
        assert got is not None, name
        assert reason is None or got == reason
    # and such a sequence still gets the host verifier's tokens beside a device-verified one
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, VOCAB)).astype(np.float32)
    mk = [(SamplingParams(temperature=0.7, presence_penalty=0.5), 11), (SamplingParams(temperature=0.9), 12)]
    host = [_seq(p, s, draft, None) for p, s in mk]
    dev = [_seq(p, s, draft, None) for p, s in mk]
    for seqs in (host, dev):
        seqs[0].output_token_ids.append(5)
        seqs[0].token_ids.append(5)
    want = sample_and_verify(logits, [], host, None)
    got = sample_and_verify_on_device(torch.from_numpy(logits), [], dev, None)
    assert [r.token for r in got] == [r.token for r in want]


@pytest.mark.slow  # (27 s: two engines on a real model; the device and host verifiers are compared above)
def test_seeded_sampling_with_ngram_speculation_gives_the_torch_runners_tokens(smollm2_gguf, monkeypatch):
    """A real model asked to repeat a passage, sampled with a seed: n-gram drafts verified on the device (GPU
    runner, on the CPU) and on the host (torch runner) give the same tokens, most drafts standing."""
    from tests.engine.test_gpu_runner import _llm, _tokens

    passage = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
               "the ninety steps and wound the clockwork that turned the great lens.")
    kw = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory="64MiB",
              speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    params = SamplingParams(temperature=0.6, top_p=0.95, seed=11, max_tokens=20)
    got = {}
    for gpu in (False, True):
        llm = _llm(smollm2_gguf, gpu, monkeypatch, **kw)
        prompt = {"prompt_token_ids": llm.encode_chat(
            [{"role": "user", "content": f"Quote the following passage word for word, then stop.\n\n{passage}"}])}
        got[gpu] = _tokens(llm.generate([prompt, prompt], [params, params]))
        if gpu:
            assert llm.engine.spec_decode_stats().acceptance_rate > 0.5
    assert got[True] == got[False]
