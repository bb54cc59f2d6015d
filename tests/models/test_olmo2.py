"""OLMo 2, a family added as one module (runlm/models/families/olmo2.py, runlm/models/olmo2.py): norms after
attention and after the MLP instead of before them, q/k norms over the whole projection. Checked as
tests/models/test_families.py checks the others: exact mode's logits within 1e-4 relative of transformers' and 64
greedy tokens through the engine equal to transformers' greedy, from safetensors and from the GGUF file llama.cpp's
own converter writes; fast mode (GGUF blocks, op by op) batch-invariant; the runner choice names why the native
runner does not run it."""
from __future__ import annotations

import pytest

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.models.test_families import matches_transformers
from tests.models.test_llama import _prompt


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_olmo2_matches_transformers(fmt: str, tiny_model) -> None:
    loaded = matches_transformers("olmo2", fmt, tiny_model)
    cfg = loaded.config
    assert cfg.family == "olmo2" and cfg.qk_norm and cfg.qk_norm_whole
    layer = loaded.model.model.layers[0]
    assert not hasattr(layer, "input_layernorm") and hasattr(layer, "post_feedforward_layernorm")


def test_fast_mode_on_gguf_blocks_is_batch_invariant_and_says_which_runner() -> None:
    llm = LLM(str(converted_gguf("olmo2", "q8_0")), block_size=4, max_num_batched_tokens=64,
              kv_cache_memory="16MiB", max_model_len=256)
    assert llm.engine.choice.describe() == "torch (the olmo2 family)"
    prompts = [{"prompt_token_ids": _prompt(49152, n, seed=n)} for n in (20, 45)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = llm.generate(prompts, params)
    for prompt, out in zip(prompts, together):
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_the_gpu_runner_gives_the_torch_runners_tokens(tiny_model, monkeypatch) -> None:
    """The GPU runner's host path (RUNLM_GPU_RUNNER=1 on the CPU, as tests/engine/test_gpu_runner.py runs it)."""
    from tests.engine.conftest import prompt_ids
    from tests.engine.test_gpu_runner import GREEDY, _llm, _tokens

    path = tiny_model("olmo2")
    prompts = [{"prompt_token_ids": prompt_ids(7 + 9 * i, seed=40 + i)} for i in range(3)]
    gpu = _tokens(_llm(path, True, monkeypatch).generate(prompts, GREEDY))
    assert gpu == _tokens(_llm(path, False, monkeypatch).generate(prompts, GREEDY))
