"""The native runner (issue 11): a GGUF model in fast mode runs without torch in the process, and computes
exactly what the torch model's fused fast path computes (the same kernels in the same order), so greedy
tokens and logits are the same bit for bit; sampling, logprobs, grammars and sleep work on it too."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from runlm.native import kernels
from tests.fixtures.gguf_convert import converted_gguf
from tests.native.engines import native_and_torch

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
KW = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory="64MiB", max_model_len=512)


def _engines(path: str) -> tuple[LLM, LLM]:
    return native_and_torch(path, **KW)


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_gguf) -> tuple[LLM, LLM]:
    return _engines(str(smollm2_gguf))


def _greedy(llm: LLM, prompts: list[str], n: int = 12, **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_generation_never_imports_torch(smollm2_gguf) -> None:
    code = textwrap.dedent(f"""
        import json, sys
        from runlm.engine.llm import LLM
        from runlm.engine.types.sampling_params import SamplingParams
        llm = LLM({str(smollm2_gguf)!r}, max_model_len=256, kv_cache_memory="32MiB")
        outs = llm.generate(["Hello", "The sky is"], [SamplingParams(temperature=0, max_tokens=8),
                            SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=8, logprobs=2)],
                            use_tqdm=False)
        json_schema = {{"type": "object", "properties": {{"a": {{"type": "integer"}}}}, "required": ["a"]}}
        from runlm.engine.types.sampling_params import StructuredOutputsParams
        llm.generate(["JSON:"], SamplingParams(max_tokens=12, structured_outputs=StructuredOutputsParams(
            json=json_schema)), use_tqdm=False)
        print(json.dumps({{"native": llm.engine.native, "torch": "torch" in sys.modules,
                          "tokens": [len(o.outputs[0].token_ids) for o in outs]}}))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"native": True, "torch": False, "tokens": [8, 8]}


def test_greedy_tokens_and_logits_equal_the_torch_fast_path(smollm2_pair) -> None:
    native, fused = smollm2_pair
    assert _greedy(native, PROMPTS) == _greedy(fused, PROMPTS)
    # the same logprobs to the bit: one forward pass computes the same floats
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, prompt_logprobs=2)
    a, b = (llm.generate(PROMPTS[:1], params, use_tqdm=False)[0] for llm in (native, fused))
    assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert a.prompt_logprobs == b.prompt_logprobs


def test_a_row_computes_the_same_alone_and_batched(smollm2_pair) -> None:
    native, _ = smollm2_pair
    batched = _greedy(native, PROMPTS, logprobs=1)
    alone = [_greedy(native, [p], logprobs=1)[0] for p in PROMPTS]
    assert batched == alone


def test_seeded_sampling_repeats_and_differs_by_seed(smollm2_pair) -> None:
    native, _ = smollm2_pair

    def run(seed: int) -> list[int]:
        p = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=seed, max_tokens=16, ignore_eos=True)
        return native.generate(PROMPTS[:1], p, use_tqdm=False)[0].outputs[0].token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sleep_and_wake_keep_the_answers(smollm2_pair) -> None:
    native, _ = smollm2_pair
    before = _greedy(native, PROMPTS[:1])
    for level in (1, 2):
        native.engine.sleep(level)
        assert native.engine.runner.kv_caches == []
        native.engine.wake_up()
        assert _greedy(native, PROMPTS[:1]) == before


@pytest.mark.parametrize("recipe", ["llama", "qwen3"])
def test_other_families_match_the_torch_fast_path(recipe: str) -> None:
    """From llama.cpp's converter: Llama (interleaved RoPE, untied head) and Qwen3 (rotate-half RoPE, per-head q/k
    norms). (Qwen2's q/k/v biases: the 0.5B-shape files of bench/quant_bench.py.)"""
    native, fused = _engines(str(converted_gguf(recipe, "q8_0")))
    ids = [[5, 17, 99, 3, 250, 41, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    a, b = (llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)[0] for llm in (native, fused))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_what_needs_torch_runs_on_torch(smollm2_gguf) -> None:
    exact = LLM(str(smollm2_gguf), exact_numerics=True, **KW)
    assert not exact.engine.native


def test_numpy_logits_are_float32(smollm2_pair) -> None:
    native, _ = smollm2_pair
    model = native.engine.loaded.model
    hidden = np.zeros((2, model.config.hidden_size), dtype=np.float32)
    logits = model.compute_logits(hidden)
    assert logits.dtype == np.float32 and logits.shape == (2, model.head.rows)
