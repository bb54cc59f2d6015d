"""Mixtures of experts on the native runner (csrc/moe_impl.h, runlm/models/native_moe.py): Mixtral,
Qwen2-MoE (its gated shared expert), Qwen3-MoE, OLMoE (unnormalized top-k, whole-projection q/k norms) from llama.cpp's converter (q8_0: the native runner takes no
fp32 matrices), against the torch
fast path on the same file. The experts' matrices go through the same block kernels, but the router's
softmax, the experts' SiLU and the shared expert's sigmoid are computed by our C++ rather than torch's
vectorized exp, so logits agree to float32 rounding (a few 1e-6 of a logprob here), not to the bit;
greedy tokens are the same."""
from __future__ import annotations

import numpy as np
import pytest

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from runlm.native import kernels
from tests.fixtures.gguf_convert import converted_gguf
from tests.native.test_native_runner import _engines

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")

IDS = [[5, 17, 99, 3, 250, 41, 7], [900, 12, 12, 4000, 77], [31, 8, 1500, 2, 64, 19, 600, 3]]
TOLERANCE = 1e-4  # on each returned logprob, in nats


def _run(llm: LLM, ids: list[list[int]], n: int = 8) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    return llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)


def _logprobs(out) -> np.ndarray:
    """Every returned logprob of a request (generated tokens' top 5 and the prompt's top 3), in a fixed order."""
    values = [lp.logprob for step in out.outputs[0].logprobs for _, lp in sorted(step.items())]
    values += [lp.logprob for step in out.prompt_logprobs if step for _, lp in sorted(step.items())]
    return np.array(values)


@pytest.mark.parametrize("recipe", ["mixtral", "qwen2-moe", "qwen3-moe", "olmoe"])
def test_experts_match_the_torch_fast_path(recipe: str) -> None:
    native, fused = _engines(str(converted_gguf(recipe, "q8_0")))
    a, b = _run(native, IDS), _run(fused, IDS)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lx, ly = _logprobs(x), _logprobs(y)
        assert lx.shape == ly.shape and np.abs(lx - ly).max() < TOLERANCE
