"""Async scheduling on the GPU runner (runlm.engine.core.overlap), on the CPU (RUNLM_GPU_RUNNER=1): step N+1 is
queued while step N's tokens are still to be read, its stand-in tokens fed from step N's draws on the device.
Every test compares with the same runner waiting for each step (async_scheduling=False) and with the torch
runner: the same tokens and text through stops, aborts mid-overlap, preemption, n > 1, chunked prefill, prefix
caching, and steps that cannot overlap (grammars, penalties) beside ones that can."""
from __future__ import annotations

import gc
import json
import weakref

import numpy as np
import pytest

from runlm.engine.core.overlap import PENDING, fed_rows
from runlm.engine.core.scheduler import SchedulerOutput
from runlm.engine.core.sequence import Sequence
from runlm.engine.llm import LLM
from runlm.engine.runners.gpu import GPURunner
from runlm.engine.types.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.conftest import prompt_ids

KW = dict(block_size=4, max_num_batched_tokens=64, kv_cache_memory="16MiB", exact_numerics=True, max_model_len=256)
SEEDED = SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True, logprobs=2)


def _llm(path, monkeypatch: pytest.MonkeyPatch, gpu: bool = True, **kw) -> LLM:
    monkeypatch.setenv("RUNLM_NATIVE_RUNNER", "0")
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1" if gpu else "0")
    llm = LLM(str(path), **{**KW, **kw})
    assert isinstance(llm.engine.runner, GPURunner) == gpu
    return llm


def _outs(outs) -> list[tuple[list[int], str, str | None]]:
    return [(list(c.token_ids), c.text, c.finish_reason) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def engines(tiny_model):
    """(async GPU runner, waiting GPU runner, torch runner) on the same tiny Qwen2."""
    mp = pytest.MonkeyPatch()
    path = tiny_model("qwen2")
    try:
        yield (_llm(path, mp), _llm(path, mp, async_scheduling=False), _llm(path, mp, gpu=False))
    finally:
        mp.undo()


def _all_equal(engines, prompts, params) -> list:
    overlapped, waiting, torch_llm = engines
    before = overlapped.engine.num_overlapped_steps
    got = overlapped.generate(prompts, params)
    assert _outs(got) == _outs(waiting.generate(prompts, params)) == _outs(torch_llm.generate(prompts, params))
    assert overlapped.engine.num_overlapped_steps > before  # (the steps did overlap)
    assert waiting.engine.num_overlapped_steps == 0
    assert overlapped.engine.blocks.usage == 0.0 or overlapped.engine.config.enable_prefix_caching
    return got


def test_seeded_n2_batch_with_logprobs(engines) -> None:
    prompts = [{"prompt_token_ids": prompt_ids(5 + 7 * i, seed=i)} for i in range(4)]
    got = _all_equal(engines, prompts, SEEDED)
    assert all(PENDING not in c.token_ids and len(c.token_ids) == 12 and len(c.logprobs) == 12
               for o in got for c in o.outputs)


def test_stop_tokens_and_stop_strings_end_sequences_a_step_early(engines) -> None:
    """Each sequence stops on a token (or a string) the previous run drew: the step queued after it is thrown away,
    and nothing of it reaches the output."""
    overlapped = engines[0]
    prompts = [{"prompt_token_ids": prompt_ids(6 + 5 * i, seed=40 + i)} for i in range(3)]
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = overlapped.generate(prompts, free)
    stops = [o.outputs[0].token_ids[3 + i] for i, o in enumerate(first)]
    got = _all_equal(engines, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                      stop_token_ids=stops))
    assert [c.finish_reason for o in got for c in o.outputs] == ["stop"] * 3
    assert all(len(c.token_ids) < 16 for o in got for c in o.outputs)
    text = first[1].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    got = _all_equal(engines, prompts[1:2], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                           stop=[stop]))
    assert got[0].outputs[0].finish_reason == "stop" and stop not in got[0].outputs[0].text


def test_one_token_requests_and_a_single_stream(engines) -> None:
    prompts = [{"prompt_token_ids": prompt_ids(9, seed=8)}]
    _all_equal(engines, prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    overlapped, waiting, _ = engines
    assert _outs(overlapped.generate(prompts * 3, one)) == _outs(waiting.generate(prompts * 3, one))


def test_chunked_prefill_and_prefix_hits(tiny_model, monkeypatch) -> None:
    path = tiny_model("qwen2")
    chunked = _llm(path, monkeypatch, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": prompt_ids(60, seed=1)}, {"prompt_token_ids": prompt_ids(6, seed=2)}]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
    want = _outs(_llm(path, monkeypatch, async_scheduling=False, max_num_batched_tokens=16).generate(prompts, params))
    assert _outs(chunked.generate(prompts, params)) == want
    again = chunked.generate(prompts, params)  # the prompts' blocks from the cache (hashed from real tokens only)
    assert _outs(again) == want and again[0].num_cached_tokens == 56


def test_preemption_mid_overlap(tiny_model, monkeypatch) -> None:
    """A cache of 30 blocks for 6 sequences of ~45 tokens: sequences are preempted while holding a stand-in, and
    recompute from their real tokens; the same draws as the waiting runner under the same pressure."""
    path = tiny_model("qwen2")
    roomy = _llm(path, monkeypatch, async_scheduling=False)
    budget = 30 * 4 * roomy.engine.kv_bytes_per_token
    tight, tight_waiting = (_llm(path, monkeypatch, kv_cache_memory=budget, async_scheduling=a) for a in (True, False))
    prompts = [{"prompt_token_ids": prompt_ids(18 + i, seed=10 + i)} for i in range(6)]
    seeded = SamplingParams(temperature=0.8, top_k=2, seed=7, max_tokens=24, ignore_eos=True)
    assert _outs(tight.generate(prompts, seeded)) == _outs(tight_waiting.generate(prompts, seeded))
    assert tight.engine.num_preemptions > 0 and tight.engine.num_overlapped_steps > 0
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert _outs(tight.generate(prompts, greedy)) == _outs(roomy.generate(prompts, greedy))


def test_abort_while_a_step_is_in_flight(engines) -> None:
    """An abort between steps, with the aborted request's next token still being drawn: its output holds only
    real tokens, its blocks are freed, and the others go on with the tokens they get alone."""
    overlapped, waiting, _ = engines
    engine = overlapped.engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt_ids(7 + i, seed=60 + i)}, params)
    for _ in range(4):
        engine.step()
    assert engine.inflight is not None and any(s.token_ids[-1] == PENDING for s in engine.requests["r1"].seqs)
    aborted = engine.abort_request("r1")
    assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    kept = aborted[0].outputs[0].token_ids
    assert PENDING not in kept and 0 < len(kept) < 10
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    alone = waiting.generate([{"prompt_token_ids": prompt_ids(7 + i, seed=60 + i)} for i in (0, 1, 2)], params)
    assert [done["r0"].outputs[0].token_ids, done["r2"].outputs[0].token_ids] == \
        [alone[0].outputs[0].token_ids, alone[2].outputs[0].token_ids]
    assert kept == alone[1].outputs[0].token_ids[:len(kept)]
    assert engine.blocks.usage == 0.0


def test_steps_that_cannot_overlap_beside_ones_that_can(engines) -> None:
    """A grammar's mask and a penalty read the previous token on the host: their steps are waited for, and every
    request still gets the waiting runner's tokens."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    grammar = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema))
    penalty = SamplingParams(temperature=0.7, seed=2, max_tokens=8, ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.5)
    overlapped, waiting, torch_llm = engines
    prompts = [{"prompt_token_ids": prompt_ids(6 + i, seed=80 + i)} for i in range(3)]
    got = overlapped.generate(prompts, [plain, grammar, penalty])
    assert _outs(got) == _outs(waiting.generate(prompts, [plain, grammar, penalty])) == \
        _outs(torch_llm.generate(prompts, [plain, grammar, penalty]))
    json.loads(got[1].outputs[0].text)
    before = overlapped.engine.num_overlapped_steps
    overlapped.generate(prompts[2:], penalty)
    assert overlapped.engine.num_overlapped_steps == before  # (a penalty's steps never overlap)


def test_streamed_deltas_hold_real_tokens_only(engines) -> None:
    overlapped, waiting, _ = engines
    engine = overlapped.engine
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    engine.add_request("d", {"prompt_token_ids": prompt_ids(5, seed=90)}, params, output_kind="delta")
    ids: list[int] = []
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            ids += o.outputs[0].token_ids
            text += o.outputs[0].text
    want = waiting.generate([{"prompt_token_ids": prompt_ids(5, seed=90)}], params)[0].outputs[0]
    assert (ids, text) == (want.token_ids, want.text)
    engine.add_request("c", {"prompt_token_ids": prompt_ids(5, seed=90)}, params)  # (cumulative)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.outputs[0].token_ids for o in engine.step()]
    assert len(seen) > 2 and all(ids == want.token_ids[:len(ids)] for ids in seen) and seen[-1] == want.token_ids


def test_fed_rows_point_each_stand_in_at_its_draw() -> None:
    params = SamplingParams()
    a, b, c = (Sequence("r", i, [5, 6, PENDING] if i != 1 else [5, 6, 7], 2, params) for i in range(3))
    sched = SchedulerOutput([a, b, c], [1, 2, 3])  # a decodes, b is mid-prompt, c recomputes all 3
    ids = np.array([PENDING, 6, 7, 5, 6, PENDING])
    assert fed_rows(sched, ids, [c, a]) == ([0, 5], [1, 0])
    assert fed_rows(sched, np.array([1, 6, 7, 5, 6, 2]), [c, a]) == ([], [])
    with pytest.raises(RuntimeError, match="no running step draws"):
        fed_rows(sched, ids, [a])


def test_queuing_the_draws_reads_nothing_back(engines, monkeypatch) -> None:
    """The device sampler's launch (greedy, seeded temperature / top-k / top-p, logprobs) reads no value back to the
    host (no .item(), .tolist(), .numpy(), nor an op whose output size depends on values), so the host is not held
    behind the step it just queued; result() is where it waits."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from runlm.engine.runners.gpu_sampler import launch_sample

    seen: list[str] = []
    for name in ("item", "tolist", "numpy", "__int__", "__float__", "__bool__"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _m=method, _n=name, **k: (
            seen.append(_n), _m(self, *a, **k))[1])

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket).removeprefix("aten.")
            seen.extend([name] if name in ("nonzero", "unique", "_unique2", "masked_select") else [])
            return func(*args, **(kwargs or {}))

    kinds = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.8, top_k=5, seed=1),
             SamplingParams(temperature=0.9, top_p=0.8, min_p=0.05, seed=2, logprobs=0)]
    seqs = [Sequence("w", i, [1, 2, 3], 3, p, generator=np.random.default_rng(i)) for i, p in enumerate(kinds)]
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with Watch():
        launch = launch_sample(logits, seqs, engines[0].engine.structured)
    assert not seen and launch.tokens is not None
    drawn = launch.result()
    assert "tolist" in seen  # (the watch sees a read back where there is one)
    assert [s.token for s in drawn] == launch.tokens.tolist() and drawn[0].token == int(logits[0].argmax())
    # a step left running holds its draws, not its [B, V] logits (the next step's sit beside them)
    held = weakref.ref(logits)
    launch = launch_sample(logits, seqs, engines[0].engine.structured)
    del logits
    gc.collect()
    assert held() is None and len(launch.result()) == 3
