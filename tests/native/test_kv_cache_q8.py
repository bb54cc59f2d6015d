"""The 8-bit KV cache (kv_cache_dtype="q8_0", csrc/kv_q8_impl.h): llama.cpp's q8_0 blocks byte for byte, ~3.76x
the tokens in the same budget, batch-invariant, and its accuracy bounded like fast mode's.

The KL bound: mean KL divergence of the next-token distribution with the q8_0 cache against the fp32 cache, on
smollm2 (Q4_1) over the first 1536 tokens of ``runlm.models.evaluate.english_text()`` in one context. llama.cpp's
own q8_0 cache on the same file and text, against its default f16 cache (llama-cpp-python 0.3.x,
``flash_attn=True``, ``type_k = type_v = q8_0``), scores LLAMA_CPP_Q8_KL (measured with
``bench/kv_cache_bench.py --context 0``, Intel Xeon with AVX-512); ours must not exceed it.
"""
from __future__ import annotations

import numpy as np
import pytest

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from runlm.kv_size import kv_cache_bytes_per_token
from runlm.native import kernels
from tests.fixtures.gguf_convert import converted_gguf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")

LLAMA_CPP_Q8_KL = 0.0  # replaced below by the measured figure
KL_POSITIONS = 1536
KW = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory="8MiB", max_model_len=512)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village, there lived"]


def _greedy(llm: LLM, prompts: list[str], n: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_blocks_are_llama_cpps_q8_0() -> None:
    from gguf import GGMLQuantizationType, quants

    from runlm.native.kv_cache import quantize_q8

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 128)) * rng.uniform(0.01, 40, (6, 1))).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block: scale 0
    ours = quantize_q8(x)
    assert ours.shape == (6, 4 * 34)
    assert np.array_equal(ours, quants.quantize(x, GGMLQuantizationType.Q8_0))
    back = kernels.dequantize(ours, int(GGMLQuantizationType.Q8_0), 128)
    assert np.abs(back - x).max() <= np.abs(x).max(axis=1, keepdims=True).max() / 127
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8(np.zeros((1, 48), np.float32))


def test_q8_0_cache_holds_3_76x_the_tokens_and_keeps_requests_independent() -> None:
    path = str(converted_gguf("qwen3", "q8_0"))  # head_dim 32
    fp32, q8 = LLM(path, **KW), LLM(path, kv_cache_dtype="q8_0", **KW)
    assert fp32.engine.native and q8.engine.native
    cfg = q8.engine.loaded.config
    assert q8.engine.kv_bytes_per_token == kv_cache_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                                   "q8_0") == fp32.engine.kv_bytes_per_token * 34 // 128
    assert len(q8.engine.blocks.blocks) == len(fp32.engine.blocks.blocks) * 128 // 34
    k, v = q8.engine.runner.kv_caches[0]
    assert k.dtype == np.uint8 and k.shape[1:] == (cfg.num_kv_heads, 34) and v.shape == k.shape
    together = _greedy(q8, PROMPTS)
    assert [_greedy(q8, [p])[0] for p in PROMPTS] == together  # batch-invariant, as the fp32 cache
    # a random tiny model's logits are nearly flat, so its tokens part soon; smollm2's KL below measures accuracy
    assert [t[:2] for t in _greedy(fp32, PROMPTS)] == [t[:2] for t in together]


def test_kl_from_the_fp32_cache_is_within_llama_cpps(smollm2_gguf) -> None:
    from runlm.engine.runners.native import native_model
    from runlm.engine.types.config import EngineConfig
    from runlm.formats.tokenizer import Tokenizer
    from runlm.models.evaluate import english_text, mean_kl, native_logits

    native = native_model(smollm2_gguf, EngineConfig(model=str(smollm2_gguf), max_model_len=KL_POSITIONS))
    assert native is not None
    ids = native.tokenizer.encode(english_text())[:KL_POSITIONS]
    assert len(ids) == KL_POSITIONS and isinstance(native.tokenizer, Tokenizer)
    fp32 = native_logits(native.model, ids, KL_POSITIONS)
    q8 = native_logits(native.model, ids, KL_POSITIONS, "q8_0")
    kl = mean_kl(fp32, q8)
    assert 0 < kl <= LLAMA_CPP_Q8_KL
    assert float((fp32.argmax(-1) == q8.argmax(-1)).float().mean()) >= 0.97


def test_where_the_torch_runner_would_run_q8_0_is_refused_with_the_reason() -> None:
    path = str(converted_gguf("qwen3", "q8_0"))
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'q8_0' needs the native runner.*exact numerics"):
        LLM(path, kv_cache_dtype="q8_0", exact_numerics=True, **KW)
    with pytest.raises(ValueError, match="head_dim a multiple of 32, not 16"):
        LLM(str(converted_gguf("llama", "q8_0")), kv_cache_dtype="q8_0", **KW)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, q8_0"):
        LLM(path, kv_cache_dtype="fp8", **KW)
