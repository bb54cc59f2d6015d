"""Gemma (1), a family added as one module (runlm/models/families/gemma.py): Llama's layer with Gemma's scaled
embeddings, 1 + w norms and GELU-tanh MLP. Checked as tests/models/test_families.py checks the others: exact mode's
logits within 1e-4 relative of transformers' and 64 greedy tokens through the engine equal to transformers' greedy,
from safetensors and from the GGUF file llama.cpp's own converter writes. The native runner on that file:
tests/native/test_native_families.py."""
from __future__ import annotations

import pytest

from runlm.models.load import load_decoder
from tests.fixtures.gguf_convert import gemma_sentencepiece_gguf
from tests.models.test_families import _reference
from tests.models.test_llama import _check, _prompt


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_gemma_matches_transformers(fmt: str, tiny_model) -> None:
    """llama.cpp's Gemma converter reads a SentencePiece vocabulary only: its GGUF comes from a tiny Gemma with one
    (the folder of gemma_sentencepiece_gguf is that transformers model)."""
    gguf = gemma_sentencepiece_gguf("gemma") if fmt == "gguf" else None
    source = tiny_model("gemma") if gguf is None else gguf.parent
    loaded = load_decoder(source if gguf is None else gguf, exact_numerics=True)
    cfg = loaded.config
    assert cfg.family == "gemma" and not cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh"
    assert cfg.embed_scale == cfg.hidden_size ** 0.5
    _check(loaded, _reference(source), _prompt(cfg.vocab_size, 200))


def test_the_native_runner_gives_the_torch_fast_paths_tokens_and_logprobs() -> None:
    """On the converter's Q8_0 file: the native runner (GELU-tanh, the embedding scale, 1 + w norms as the file
    stores them) against the torch fast path, greedy tokens identical and logprobs within 1e-5."""
    from runlm.engine.types.sampling_params import SamplingParams
    from runlm.native import kernels
    from tests.fixtures.gguf_convert import convert_dir
    from tests.native.engines import native_and_torch

    if not kernels.available():
        pytest.skip("the native kernels are unavailable here")
    source = gemma_sentencepiece_gguf("gemma").parent
    q8 = convert_dir(source, source.parent / f"{source.name}-gguf-q8_0" / "gemma-sp.q8_0.gguf", "q8_0")
    native, fused = native_and_torch(str(q8), max_model_len=256, kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    prompts = ["The capital of France is", "Once upon a time, in a small village, there lived"]
    ours, theirs = native.generate(prompts, params), fused.generate(prompts, params)
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for mine, ref in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(mine) == set(ref) and all(abs(mine[t].logprob - ref[t].logprob) <= 1e-5 for t in mine)
