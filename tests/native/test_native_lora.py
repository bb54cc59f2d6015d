"""LoRA on the native runner (issue 30): the adapters' low-rank updates run inside the native decoder step
(csrc/lora_impl.h), rows grouped by adapter, and compute the torch fast path's numbers to the bit (both
are fp32 products in one reduction order added into the same base output): greedy tokens and logprobs
equal; a mixed batch gives each row what it gets alone; bad adapters and keys are refused clearly."""
from __future__ import annotations

import numpy as np
import pytest

from runlm.engine.llm import LLM
from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.sampling_params import SamplingParams
from runlm.native import kernels
from runlm.native import lora as native_lora
from tests.engine.conftest import prompt_ids
from tests.fixtures.gguf_convert import converted_gguf
from tests.fixtures.lora import gguf_adapter, peft_adapter
from tests.native.engines import native_and_torch

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")

KW = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory="64MiB", max_model_len=256, enable_lora=True,
          max_loras=2, max_lora_rank=8, max_cpu_loras=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _engines(path: str) -> tuple[LLM, LLM]:
    return native_and_torch(path, **KW)


@pytest.fixture(scope="module")
def llama_q8_pair() -> tuple[LLM, LLM]:
    return _engines(str(converted_gguf("llama", "q8_0")))


def _adapters() -> tuple[LoRARequest, LoRARequest]:
    return (LoRARequest("a", 1, str(peft_adapter("llama", 8))),
            LoRARequest("b", 2, str(peft_adapter("llama", 8, seed=1, targets=("q_proj", "v_proj", "down_proj")))))


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": prompt_ids(6 + 5 * i, seed=70 + i)} for i in range(n)]


def test_logprobs_equal_the_torch_fast_path_bit_for_bit(llama_q8_pair) -> None:
    native, fused = llama_q8_pair
    a, _ = _adapters()
    gguf_a = LoRARequest("a-gguf", 3, str(gguf_adapter(peft_adapter("llama", 8), "llama")))
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=2, ignore_eos=True)
    prompt = _prompts(1)
    for lora in (a, gguf_a):
        ours, theirs = (llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0] for llm in (native, fused))
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].logprobs == theirs.outputs[0].logprobs
        assert ours.prompt_logprobs == theirs.prompt_logprobs
    base = native.generate(prompt, params, use_tqdm=False)[0]
    assert base.outputs[0].logprobs != ours.outputs[0].logprobs  # the adapter is applied at all


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(llama_q8_pair) -> None:
    native, fused = llama_q8_pair
    a, b = _adapters()
    prompts, loras = _prompts(6), [None, a, b, a, None, b]
    together = _tokens(native.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    assert together == _tokens(fused.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    native.reset_prefix_cache()
    for prompt, lora, expected in zip(prompts, loras, together):
        assert _tokens(native.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)) == [expected]
    answers = _tokens(native.generate([prompts[0]] * 3, GREEDY, use_tqdm=False, lora_request=[None, a, b]))
    assert len({tuple(t) for t in answers}) == 3


def test_removed_adapters_leave_the_decoder_and_bad_ones_are_refused(llama_q8_pair) -> None:
    native, _ = llama_q8_pair
    a, _ = _adapters()
    native.add_lora(a)
    assert native.remove_lora(a.lora_int_id)
    decoder = native.engine.loaded.model.decoder
    with pytest.raises(ValueError, match="no LoRA adapter with key"):
        native_lora.set_rows(decoder, np.array([0, 12345], dtype=np.int64))
    native_lora.set_rows(decoder, None)
    bad_b = native_lora.Shard(0, 64, np.zeros((63, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="does not fit"):
        native_lora.set_adapter(decoder, 99, [native_lora.Update(0, "qkv", [np.zeros((4, 64), np.float32)], [bad_b])])
    wide = native_lora.Shard(0, 10**6, np.zeros((10**6, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="does not fit a layer"):
        native_lora.set_adapter(decoder, 99, [native_lora.Update(0, "o", [np.zeros((4, 64), np.float32)], [wide])])
    with pytest.raises(ValueError, match="LoRA A has 7 columns, the projection takes 64"):
        native_lora.set_adapter(decoder, 99, [native_lora.Update(0, "o", [np.zeros((4, 7), np.float32)], [native_lora.Shard(0, 64, np.zeros((64, 4), np.float32))])])
    with pytest.raises(ValueError, match="no LoRA adapter with key 99"):  # a refused adapter is not half set
        native_lora.set_rows(decoder, np.array([99], dtype=np.int64))
    native_lora.set_rows(decoder, None)


def test_fp16_adapters_give_the_same_greedy_tokens_and_close_logprobs(llama_q8_pair, monkeypatch) -> None:
    """Adapters stored as fp16 (half the bytes per decode step): the torch path's greedy tokens, and every
    sampled token's logprob within 0.1 of the fp32 adapter's (measured: up to 0.07 on this random model, whose
    random adapter moves the logits far more than a trained one does)."""
    from runlm.models import native_lora as models_native_lora

    native, fused = llama_q8_pair
    path = str(peft_adapter("llama", 8))
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    prompts = _prompts(3)
    theirs = fused.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("a", 1, path))
    monkeypatch.setattr(models_native_lora, "HALF", True)
    ours = native.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("a16", 21, path))
    assert _tokens(ours) == _tokens(theirs)
    diffs = [abs(a[t].logprob - b[t].logprob) for o, f in zip(ours, theirs)
             for t, a, b in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, f.outputs[0].logprobs)]
    assert 0 < max(diffs) < 0.1, max(diffs)  # not the fp32 bits, and close to them


def test_adapters_survive_sleep_and_wake_on_the_native_runner() -> None:
    llm = LLM(str(converted_gguf("llama", "q8_0")), kv_cache_memory="16MiB", max_model_len=128, enable_lora=True,
              max_lora_rank=8)
    assert llm.engine.native
    a, _ = _adapters()
    prompt = _prompts(1)
    before = _tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a))
    assert before != _tokens(llm.generate(prompt, GREEDY, use_tqdm=False))
    llm.engine.sleep(2)  # the weights (and the native decoder) are dropped: the adapter is set on the new ones
    llm.engine.wake_up()
    assert _tokens(llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)) == before


def test_odd_shapes_compute_what_the_whole_blocks_compute(llama_q8_pair) -> None:
    """A rank-5 update on columns 3..14 (8 outputs a vector, 3 one at a time; 5 of 8 lanes) gives the bits of
    the same update padded with zeros to columns 0..16 (all vectors); and it changes the output."""
    native, _ = llama_q8_pair
    decoder = native.engine.loaded.model.decoder
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((5, 64)) * 0.3).astype(np.float32)
    b = (rng.standard_normal((11, 5)) * 0.3).astype(np.float32)
    padded = np.zeros((16, 5), dtype=np.float32)
    padded[3:14] = b
    native_lora.set_adapter(decoder, 31, [native_lora.Update(1, "o", [a], [native_lora.Shard(3, 14, b)])])
    native_lora.set_adapter(decoder, 32, [native_lora.Update(1, "o", [a], [native_lora.Shard(0, 16, padded)])])
    t = 7
    ids, pos = np.arange(10, 10 + t, dtype=np.int64), np.arange(t, dtype=np.int64)
    outs = []
    try:
        for key in (0, 31, 32):
            native_lora.set_rows(decoder, np.full(t, key, dtype=np.int64))
            out = np.empty((t, decoder.hidden), dtype=np.float32)
            decoder.forward(ids, pos, pos.copy(), np.array([t]), np.array([t]), pos.copy(), out)
            outs.append(out)
    finally:
        native_lora.set_rows(decoder, None)
        native_lora.drop_adapter(decoder, 31)
        native_lora.drop_adapter(decoder, 32)
        native.reset_prefix_cache()  # (the steps wrote slots 0..6)
    assert np.array_equal(outs[1], outs[2])
    assert not np.array_equal(outs[0], outs[1])
