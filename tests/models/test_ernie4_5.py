"""ERNIE 4.5 (dense), a family added as one module (runlm/models/families/ernie4_5.py): Llama's layer with RoPE
rotating feature pairs (2i, 2i+1), as its checkpoints are trained. Exact mode within 1e-4 of transformers and its
greedy tokens, from safetensors (the model rotates pairs) and from llama.cpp's GGUF (the same layout, read as
Llama's files are); rotating halves instead would not match; the GPU runner refuses it by name."""
from __future__ import annotations

import pytest
import torch

from runlm.engine.llm import LLM
from runlm.models.load import load_decoder
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.models.test_families import _reference, matches_transformers
from tests.models.test_llama import _our_logits, _prompt


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_ernie4_5_matches_transformers(fmt: str, tiny_model) -> None:
    loaded = matches_transformers("ernie4_5", fmt, tiny_model)
    assert loaded.config.family == "ernie4_5"
    assert loaded.model.model.rope.interleaved == (fmt == "safetensors")  # GGUF's dense mode unpermutes to halves


def test_rotating_halves_would_not_match(tiny_model) -> None:
    path = tiny_model("ernie4_5")
    loaded = load_decoder(path, exact_numerics=True)
    prompt = _prompt(loaded.config.vocab_size, 64)
    with torch.inference_mode():
        reference = _reference(path)(torch.tensor([prompt])).logits[0]
    assert (_our_logits(loaded, prompt) - reference).abs().max() < 1e-3 * reference.abs().max()
    halves = load_decoder(path, exact_numerics=True)
    halves.model.model.rope.interleaved = False
    halves.model.model.rope._build(halves.model.model.rope.cos.shape[0])
    assert (_our_logits(halves, prompt) - reference).abs().max() > 1e-2 * reference.abs().max()


def test_fast_mode_runs_from_gguf_blocks() -> None:
    llm = LLM(str(converted_gguf("ernie4_5", "q8_0")), max_model_len=256, kv_cache_memory="16MiB")
    assert llm.generate(["The capital of France is"])[0].outputs[0].token_ids
