"""--kv-cache-dtype fp8 on the GPU runner (vLLM's name: float8 e4m3, a scale of 1), on the CPU: the cache holds a byte
a value (half a bf16 cache's), a request's tokens do not depend on its batch, and its cost in accuracy is measured
and bounded against the bf16 cache on real weights (SmolLM2-135M). The kernels' own encode and read of the fp8
bytes: tests/kernels/test_gpu_triton_attention.py (interpreted, compiled for sm_90, on CUDA)."""
from __future__ import annotations

import pytest
import torch

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
KW = dict(block_size=4, max_num_batched_tokens=64, kv_cache_memory="16MiB", max_model_len=256)
# mean KL (nats) of the next-token distributions, fp8 cache vs bf16 cache, over 256 positions of english_text():
# 0.0089 measured (top-1 agreement 93.8%; the bf16 cache itself is 3e-5 from fp32's), AMD EPYC
FP8_KL_BOUND = 0.015


def _llm(path, monkeypatch, **kw) -> LLM:
    monkeypatch.setenv("RUNLM_NATIVE_RUNNER", "0")
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1")
    return LLM(str(path), **{**KW, **kw})


def test_an_fp8_cache_holds_a_byte_a_value_and_keeps_batch_invariance(tiny_model, monkeypatch) -> None:
    path = tiny_model("qwen2")
    full, fp8 = _llm(path, monkeypatch), _llm(path, monkeypatch, kv_cache_dtype="fp8")
    assert fp8.engine.runner.backend.caches[0][0].dtype == torch.float8_e4m3fn
    assert fp8.engine.kv_bytes_per_token * 4 == full.engine.kv_bytes_per_token  # (fp32 here; bf16 on a GPU: 2)
    assert len(fp8.engine.blocks.blocks) >= 4 * len(full.engine.blocks.blocks) - 4  # 4x the tokens, same budget
    prompts = [{"prompt_token_ids": prompt_ids(6 + 9 * i, seed=40 + i)} for i in range(4)]
    together = [o.outputs[0].token_ids for o in fp8.generate(prompts, GREEDY)]
    alone = [fp8.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    fp8.reset_prefix_cache()
    first, again = (fp8.generate(prompts[3:], GREEDY)[0] for _ in range(2))
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_fp8_is_the_gpu_runners(tiny_model, monkeypatch) -> None:
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "0")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' needs the tensor-parallel gpu or gpu runner, which runs on a GPU"):
        LLM(str(tiny_model("qwen2")), **KW, kv_cache_dtype="fp8")


def test_the_fp8_caches_kl_from_the_bf16_cache_is_bounded(smollm2_gguf) -> None:
    from runlm.models.evaluate import english_text, mean_kl, paged_logits
    from runlm.models.gpu_load import load_to_device

    loaded = load_to_device(smollm2_gguf, dtype="float32", device="cpu", gguf_blocks=False)
    ids = loaded.tokenizer.encode(english_text())[:256]
    bf16, fp8 = (paged_logits(loaded.model, ids, dtype) for dtype in (torch.bfloat16, torch.float8_e4m3fn))
    kl = mean_kl(bf16, fp8)
    assert 0 < kl <= FP8_KL_BOUND, kl
    assert (bf16.argmax(-1) == fp8.argmax(-1)).float().mean() >= 0.9
