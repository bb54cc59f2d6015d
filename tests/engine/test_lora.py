"""LoRA adapters against the ``peft`` library, and in the engine: mixed batches, the prefix cache, the
adapter cache (LRU, pins, remove while running) and the refusals.

Adapters are made by peft on the generated models with random A and B (tests/fixtures/lora.py); the
GGUF ones by llama.cpp's convert_lora_to_gguf.py from the same adapters.
"""
from __future__ import annotations

import asyncio

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from runlm.engine.async_llm import AsyncLLM
from runlm.engine.core.lora_manager import LoRAManager
from runlm.engine.llm import LLM
from runlm.engine.types.errors import LoRAError
from runlm.engine.types.lora_request import LoRARequest
from runlm.engine.types.sampling_params import SamplingParams
from runlm.models.attention import ForwardContext, forward_context
from runlm.models.load import load_decoder
from tests.engine.conftest import prompt_ids
from tests.fixtures.gguf_convert import converted_gguf
from tests.fixtures.lora import gguf_adapter, peft_adapter

RTOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _logits(loaded, manager: LoRAManager | None, key: int, ids: list[int]) -> torch.Tensor:
    batch = manager.batch([key]) if manager else torch.no_grad()
    with torch.inference_mode(), batch, forward_context(ForwardContext.no_cache([len(ids)])):
        return loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids))))


def _peft_logits(base, adapter, ids: list[int]) -> torch.Tensor:
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0]


def _rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.mark.parametrize(("recipe", "rank", "rslora"), [("llama", 8, False), ("llama", 64, True),
                                                         ("qwen2", 8, True), ("qwen2", 64, False)])
def test_logits_equal_peft_in_exact_mode(recipe: str, rank: int, rslora: bool, tiny_model) -> None:
    base, adapter = tiny_model(recipe), peft_adapter(recipe, rank, rslora)
    ids = prompt_ids(40, seed=rank)
    loaded = load_decoder(base, exact_numerics=True)
    manager = LoRAManager(loaded.model, loaded.config, max_loras=1, max_lora_rank=64, max_cpu_loras=None)
    key = manager.acquire(LoRARequest("a", 1, str(adapter)))
    theirs = _peft_logits(base, adapter, ids)
    ours = _logits(loaded, manager, key, ids)
    assert _rel(ours, theirs) < RTOL
    assert _rel(_logits(loaded, None, 0, ids), theirs) > 0.05  # the adapter changes the answer


def test_fused_target_modules_equal_peft(tiny_model) -> None:
    """Phi-3 names its projections fused (qkv_proj, gate_up_proj): an adapter on them fills the whole layer."""
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    base, adapter = tiny_model("phi3"), peft_adapter("phi3", 8, targets=targets)
    ids = prompt_ids(30, seed=8)
    loaded = load_decoder(base, exact_numerics=True)
    manager = LoRAManager(loaded.model, loaded.config, 1, 8, None)
    key = manager.acquire(LoRARequest("fused", 1, str(adapter)))
    assert _rel(_logits(loaded, manager, key, ids), _peft_logits(base, adapter, ids)) < RTOL


def test_gguf_adapter_equals_its_peft_source_on_gguf_and_safetensors_bases(tiny_model) -> None:
    """convert_lora_to_gguf.py permutes Q/K rows of B for llama.cpp's RoPE layout: read back, the adapter must
    give PEFT's logits on the safetensors base, and on the GGUF base in fast mode (Q/K kept interleaved)."""
    adapter = peft_adapter("llama", 8)
    ids = prompt_ids(40, seed=5)
    theirs = _peft_logits(tiny_model("llama"), adapter, ids)
    for base, exact in ((tiny_model("llama"), True), (converted_gguf("llama", "f32"), False)):
        loaded = load_decoder(base, exact_numerics=exact)
        manager = LoRAManager(loaded.model, loaded.config, 2, 16, None)
        for i, path in enumerate((adapter, gguf_adapter(adapter, "llama"))):
            key = manager.acquire(LoRARequest(f"a{i}", i + 1, str(path)))
            assert _rel(_logits(loaded, manager, key, ids), theirs) < RTOL, (base.name, path.name)


def test_adapter_runs_in_fp32_beside_a_quantized_base(tiny_model) -> None:
    """Q8_0 blocks computed as stored (fast mode) plus the fp32 update: close to exact mode with the adapter,
    far from either without it."""
    adapter = str(peft_adapter("llama", 8))
    ids = prompt_ids(40, seed=6)
    logits = {}
    for exact in (True, False):
        loaded = load_decoder(converted_gguf("llama", "q8_0"), exact_numerics=exact)
        manager = LoRAManager(loaded.model, loaded.config, 1, 16, None)
        key = manager.acquire(LoRARequest("a", 1, adapter))
        logits[exact] = (_logits(loaded, manager, key, ids), _logits(loaded, None, 0, ids))
    with_lora, base_only = _kl(logits[True][0], logits[False][0]), _kl(logits[True][1], logits[False][1])
    assert with_lora < 0.01 and with_lora < 2 * base_only  # the adapter adds no error of its own
    assert _kl(logits[True][0], logits[False][1]) > 1.0


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """Mean KL(p || q) over positions, from logits."""
    lp, lq = torch.log_softmax(p, -1), torch.log_softmax(q, -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean().item()


@pytest.fixture(scope="module")
def lora_llm(tiny_model) -> LLM:
    return LLM(str(tiny_model("qwen2")), block_size=4, max_num_batched_tokens=64, kv_cache_memory="64MiB",
               enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=4)


def _adapters() -> tuple[LoRARequest, LoRARequest]:
    return (LoRARequest("a", 1, str(peft_adapter("qwen2", 8, seed=1))),
            LoRARequest("b", 2, str(peft_adapter("qwen2", 8, seed=2, targets=("q_proj", "v_proj")))))


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(lora_llm: LLM) -> None:
    a, b = _adapters()
    prompts = [{"prompt_token_ids": prompt_ids(6 + 5 * i, seed=40 + i)} for i in range(6)]
    loras = [None, a, b, a, None, b]
    together = _tokens(lora_llm.generate(prompts, GREEDY, lora_request=loras))
    lora_llm.reset_prefix_cache()
    for prompt, lora, expected in zip(prompts, loras, together):
        assert _tokens(lora_llm.generate([prompt], GREEDY, lora_request=lora)) == [expected]
    # and the adapters matter: the same prompt under base, a and b gives three answers
    same = [prompts[0]] * 3
    answers = _tokens(lora_llm.generate(same, GREEDY, lora_request=[None, a, b]))
    assert len({tuple(t) for t in answers}) == 3


def test_prefix_cache_never_shares_kv_between_adapters(lora_llm: LLM) -> None:
    a, b = _adapters()
    prompt = [{"prompt_token_ids": prompt_ids(40, seed=99)}]
    lora_llm.reset_prefix_cache()
    stats = lora_llm.engine.blocks.stats
    under_a = _tokens(lora_llm.generate(prompt, GREEDY, lora_request=a))
    under_b = _tokens(lora_llm.generate(prompt, GREEDY, lora_request=b))
    assert stats.hits == 0
    assert _tokens(lora_llm.generate(prompt, GREEDY, lora_request=a)) == under_a
    assert stats.hits > 0  # the same adapter does share its blocks
    lora_llm.reset_prefix_cache()
    assert _tokens(lora_llm.generate(prompt, GREEDY, lora_request=b)) == under_b


def test_max_loras_bounds_the_adapters_in_one_step(tiny_model) -> None:
    llm = LLM(str(tiny_model("qwen2")), block_size=4, kv_cache_memory="64MiB", enable_lora=True, max_loras=1,
              max_lora_rank=8, max_cpu_loras=2)
    engine = llm.engine
    for i, lora in enumerate((*_adapters(), None, _adapters()[0])):
        engine.add_request(str(i), {"prompt_token_ids": prompt_ids(8, seed=i)}, GREEDY, lora_request=lora)
    seen = set()
    while engine.has_unfinished_requests():
        keys = {s.lora_key for s in engine.scheduler.running if s.lora_key}
        assert len(keys) <= 1
        seen |= keys
        engine.step()
    assert len(seen) == 2  # both adapters ran, one after the other


def test_lru_eviction_spares_pinned_adapters(tiny_model) -> None:
    llm = LLM(str(tiny_model("qwen2")), kv_cache_memory="64MiB", enable_lora=True, max_loras=1, max_lora_rank=8,
              max_cpu_loras=2)
    path = str(peft_adapter("qwen2", 8, seed=1))
    assert llm.add_lora(LoRARequest("one", 1, path)) and llm.add_lora(LoRARequest("two", 2, path))
    assert not llm.add_lora(LoRARequest("one", 1, path))  # already loaded: now the most recent
    llm.pin_lora(2)
    llm.add_lora(LoRARequest("three", 3, path))
    assert llm.list_loras() == {2, 3}  # 1 was least recently used but 2 is pinned: 1 went
    llm.add_lora(LoRARequest("four", 4, path))
    assert llm.list_loras() == {2, 4}
    assert llm.remove_lora(2) and not llm.remove_lora(2)
    assert llm.list_loras() == {4}
    assert llm.engine.lora is not None and set(llm.engine.lora.by_key) == {llm.engine.lora.loaded[4].key}


def test_remove_while_running_lets_running_requests_finish_with_it(lora_llm: LLM) -> None:
    a, _ = _adapters()
    prompt = {"prompt_token_ids": prompt_ids(10, seed=7)}
    expected = _tokens(lora_llm.generate([prompt], GREEDY, lora_request=a))
    engine = lora_llm.engine
    engine.add_request("running", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       lora_request=a)
    engine.step()
    assert engine.lora is not None
    key = engine.lora.loaded[1].key
    assert lora_llm.remove_lora(1) and 1 not in lora_llm.list_loras()
    assert key in engine.lora.by_key  # still attached: a running request uses it
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final is not None and final.outputs[0].token_ids == expected[0]
    assert key not in engine.lora.by_key  # detached once its last user finished
    # a later request with the adapter's path loads it again
    assert _tokens(lora_llm.generate([prompt], GREEDY, lora_request=a)) == expected


def test_bad_adapters_are_refused_naming_the_module(lora_llm: LLM, tiny_model) -> None:
    with pytest.raises(LoRAError, match="lm_head"):
        lora_llm.add_lora(LoRARequest("head", 11, str(peft_adapter("qwen2", 8, targets=("lm_head",)))))
    with pytest.raises(LoRAError, match=r"module 'model\.layers\.\d+\.self_attn\.\w+' maps 64 -> \d+ features, but the model's"):
        lora_llm.add_lora(LoRARequest("qwen3", 12, str(peft_adapter("qwen3", 8))))
    with pytest.raises(LoRAError, match="rank 64, above max_lora_rank 8"):
        lora_llm.add_lora(LoRARequest("big", 13, str(peft_adapter("qwen2", 64))))
    with pytest.raises(LoRAError, match="does not exist"):
        lora_llm.generate("hi", GREEDY, lora_request=LoRARequest("gone", 14, "/nonexistent/adapter"))
    assert not lora_llm.engine.has_unfinished_requests() and 12 not in lora_llm.list_loras()
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, "x")
    plain = LLM(str(tiny_model("qwen2")), kv_cache_memory="16MiB")
    with pytest.raises(LoRAError, match="enable_lora"):
        plain.generate("hi", GREEDY, lora_request=_adapters()[0])


def test_async_llm_generates_with_adapters(lora_llm: LLM) -> None:
    a, b = _adapters()
    prompt = {"prompt_token_ids": prompt_ids(9, seed=3)}
    expected = _tokens(lora_llm.generate([prompt] * 2, GREEDY, lora_request=[a, b]))

    async def run() -> list[list[int]]:
        llm = AsyncLLM(engine=lora_llm.engine)
        try:
            assert await llm.add_lora(b) in (True, False)
            assert 2 in await llm.list_loras()

            async def one(lora: LoRARequest) -> list[int]:
                tokens: list[int] = []
                async for out in llm.generate(prompt, GREEDY, lora_request=lora):
                    tokens += out.outputs[0].token_ids
                return tokens
            return list(await asyncio.gather(one(a), one(b)))
        finally:
            llm.shutdown()
    assert asyncio.run(run()) == expected


def test_adapters_survive_sleep_and_wake(tiny_model) -> None:
    llm = LLM(str(tiny_model("qwen2")), kv_cache_memory="16MiB", enable_lora=True, max_lora_rank=8)
    a, _ = _adapters()
    prompt = [{"prompt_token_ids": prompt_ids(12, seed=21)}]
    before = _tokens(llm.generate(prompt, GREEDY, lora_request=a))
    llm.engine.sleep(2)  # the weights are dropped and reloaded: the adapter is attached to the new ones
    llm.engine.wake_up()
    assert _tokens(llm.generate(prompt, GREEDY, lora_request=a)) == before
