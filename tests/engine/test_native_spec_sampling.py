"""The distribution test's native twin (issue 30): on the native runner, with a native draft model, seeded requests
at temperature 1 sample their drafted positions from the same distribution as without speculation."""
from __future__ import annotations

import pytest

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from runlm.native import kernels
from tests.engine.conftest import prompt_ids
from tests.engine.test_spec_decode_sampling import assert_same_histograms
from tests.fixtures.gguf_convert import converted_gguf
from tests.fixtures.near_copy import near_copy_gguf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")


@pytest.mark.slow  # ~5 s on an idle 2-core machine, 11 s shared; the torch twin is slow too
def test_native_samples_match_with_and_without_a_native_draft() -> None:
    """Top-k 3 at temperature 1: the second and third tokens, which the draft proposes and the target verifies,
    have the same histogram with a draft as without (two-sample chi-square at 0.999)."""
    target = str(converted_gguf("llama", "q8_0"))
    prompt = {"prompt_token_ids": prompt_ids(8, seed=3, vocab=32000)}
    n = 200
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True, seed=i) for i in range(n)]
    kw = dict(block_size=4, max_num_batched_tokens=256, kv_cache_memory="64MiB")
    plain_llm = LLM(target, **kw)
    plain = plain_llm.generate([prompt] * n, params, use_tqdm=False)
    llm = LLM(target, **kw, speculative_config={"model": str(near_copy_gguf("llama", 0.05)),
                                                "num_speculative_tokens": 2, "min_acceptance_rate": 0})
    spec = llm.generate([prompt] * n, params, use_tqdm=False)
    assert plain_llm.engine.native and llm.engine.native
    assert llm.engine.spec is not None and llm.engine.spec.draft is not None and llm.engine.spec.draft.native
    assert llm.engine.spec.stats.num_accepted_tokens > 20
    assert_same_histograms(plain, spec)
