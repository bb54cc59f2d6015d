"""The native runner's default KV cache: fp16 rows (llama.cpp's and Ollama's default), half the fp32 cache's
memory, each value the fp32 one rounded to nearest, batch-invariant, and no cost in the fast mode's KL bound:
fast mode's KL from exact mode with the fp16 cache is no larger than with the fp32 one (smollm2, 4096 positions
of english_text() in 512-token windows, as test_fast_numerics measures it: fp32 0.003227, fp16 0.003103 on an AMD
EPYC with AVX-512)."""
from __future__ import annotations

import numpy as np
import pytest

from runlm.engine.llm import LLM
from runlm.native import kernels
from runlm.native.kv_cache import allocate
from tests.fixtures.gguf_convert import converted_gguf
from tests.native.engines import KV_KW, KV_PROMPTS, greedy

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")

KW, PROMPTS = KV_KW, KV_PROMPTS


def test_the_native_default_is_fp16_at_half_the_memory_and_requests_stay_independent() -> None:
    path = str(converted_gguf("llama", "q8_0"))  # head_dim 16
    default, fp32 = LLM(path, **KW), LLM(path, kv_cache_dtype="fp32", **KW)
    assert default.engine.native and default.engine.config.kv_cache_dtype == "fp16"
    assert default.engine.kv_bytes_per_token * 2 == fp32.engine.kv_bytes_per_token
    assert len(default.engine.blocks.blocks) == 2 * len(fp32.engine.blocks.blocks)  # the same budget, twice the tokens
    k, v = default.engine.runner.kv_caches[0]
    assert k.dtype == np.float16 and v.shape == k.shape
    together = greedy(default, PROMPTS)
    assert [greedy(default, [p])[0] for p in PROMPTS] == together
    exact = LLM(path, exact_numerics=True, **KW)  # exact mode keeps the reference numerics: an fp32 cache
    assert not exact.engine.native and exact.engine.config.kv_cache_dtype == "auto"


def test_cached_values_are_the_fp32_ones_rounded_to_nearest(smollm2_gguf) -> None:
    from runlm.engine.runners.native import native_model
    from runlm.engine.types.config import EngineConfig

    native = native_model(smollm2_gguf, EngineConfig(model=str(smollm2_gguf), max_model_len=64))
    assert native is not None
    cfg, decoder = native.model.config, native.model.decoder
    ids = np.asarray(native.tokenizer.encode("The lighthouse keeper opened the bottle and read the note"), np.int64)
    n = len(ids)

    def run(dtype: str) -> list[tuple[np.ndarray, np.ndarray]]:
        caches = [allocate(dtype, n, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
        decoder.set_kv_caches(caches)
        slots, lens = np.arange(n, dtype=np.int64), np.array([n], dtype=np.int64)
        decoder.forward(ids, slots, slots, lens, lens, slots, np.empty((n, cfg.hidden_size), np.float32))
        return caches

    fp32, fp16 = run("fp32"), run("fp16")
    # the first layer's K/V come from the same inputs: exactly numpy's round-to-nearest of the fp32 values
    assert np.array_equal(fp32[0][0].astype(np.float16), fp16[0][0])
    assert np.array_equal(fp32[0][1].astype(np.float16), fp16[0][1])


@pytest.mark.slow  # 4096 positions of smollm2 three times: ~1-2 min on 2 shared cores
def test_fp16_costs_nothing_in_fast_modes_kl_bound(smollm2_gguf) -> None:
    from runlm.engine.runners.native import native_model
    from runlm.engine.types.config import EngineConfig
    from runlm.models.evaluate import all_logits, english_text, mean_kl, native_logits
    from runlm.models.load import load_decoder

    exact = load_decoder(smollm2_gguf, exact_numerics=True)
    ids = exact.tokenizer.encode(english_text())[:4096]
    reference = all_logits(exact.model, ids)
    native = native_model(smollm2_gguf, EngineConfig(model=str(smollm2_gguf), max_model_len=512))
    assert native is not None
    kl = {d: mean_kl(reference, native_logits(native.model, ids, 512, d)) for d in ("fp32", "fp16")}
    assert 0 < kl["fp16"] <= kl["fp32"] * 1.02, kl
