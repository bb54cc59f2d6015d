"""The Llama-family decoder against transformers on the same weights.

Exact mode (``exact_numerics=True``: dequantized weights times fp32 activations) is what is
compared. Tolerance: fp32 last-position logits agree to 1e-4 relative (max |ours - ref| / max |ref|);
64 greedy tokens (decoded through our KV cache) are identical. The fast default mode is held to a
KL-divergence bound against exact mode in test_fast_numerics.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from runlm.models.attention import ForwardContext, forward_context
from runlm.models.load import load_decoder
from tests.fixtures.models import FAMILY_RECIPES, HYBRID_RECIPES, RECIPES, gguf_reference_dir

GREEDY_TOKENS = 64
RTOL = 1e-4


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _our_logits(loaded, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode(), forward_context(ForwardContext.no_cache([len(ids)])):
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)))
        return loaded.model.compute_logits(hidden)


def _reference_greedy(ref, ids: list[int]) -> list[int]:
    """transformers' forward with its own KV cache, argmax each step, never stopping at EOS. (Each step's position
    given: a hybrid's cache counts its length by its first layer, which may hold a recurrent state, not K/V.)"""
    tokens = []
    with torch.inference_mode():
        step = ref(torch.tensor([ids]), use_cache=True)
        for i in range(GREEDY_TOKENS):
            token = int(step.logits[0, -1].argmax())
            tokens.append(token)
            step = ref(torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True,
                       position_ids=torch.tensor([[len(ids) + i]]))
    return tokens


def _check(loaded, ref, ids: list[int]) -> None:
    ours = _our_logits(loaded, ids)
    with torch.inference_mode():
        theirs = ref(torch.tensor([ids])).logits[0]
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert rel < RTOL, f"logits differ by {rel:.2e} relative"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    # greedy decoding through the engine (paged KV cache, block size 4 to cross many block edges)
    llm = LLM(str(loaded.path), block_size=4, kv_cache_memory="64MiB", max_model_len=1024, exact_numerics=True)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    greedy = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    assert greedy == _reference_greedy(ref, ids)


@pytest.mark.parametrize("recipe", sorted(set(RECIPES) - set(FAMILY_RECIPES) - set(HYBRID_RECIPES)))
def test_generated_models_match_transformers(recipe: str, tiny_model) -> None:
    path = tiny_model(recipe)
    loaded = load_decoder(path, exact_numerics=True)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _check(loaded, ref, _prompt(loaded.config.vocab_size, 200))


def _gguf_reference(path: Path):
    """transformers on the GGUF file (read by its own GGUF loader once, kept as safetensors)."""
    return AutoModelForCausalLM.from_pretrained(str(gguf_reference_dir(path)), dtype=torch.float32).eval()


def test_tinycoder_gguf_matches_transformers(tinycoder_gguf: Path) -> None:
    loaded = load_decoder(tinycoder_gguf, exact_numerics=True)
    ids = loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    _check(loaded, _gguf_reference(tinycoder_gguf), ids)


def test_smollm2_gguf_matches_transformers(smollm2_gguf: Path) -> None:
    loaded = load_decoder(smollm2_gguf, exact_numerics=True)
    assert loaded.config.tie_word_embeddings and loaded.config.num_kv_heads == 3
    ids = loaded.tokenizer.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    _check(loaded, _gguf_reference(smollm2_gguf), ids)


def test_smollm2_int8_block_weights_give_the_dense_logits(smollm2_gguf: Path, monkeypatch) -> None:
    """Exact mode: Q4_1/Q8_0 layers kept as int8 blocks compute exactly the fp32 dequantized model's logits."""
    import runlm.kernels as kernels_module

    quantized = load_decoder(smollm2_gguf, exact_numerics=True)
    modules = [m for m in quantized.model.modules() if getattr(m, "qweight", None) is not None]
    if not modules:
        pytest.skip("the linear kernels are unavailable here, so nothing is kept quantized")
    assert len(modules) == 4 * quantized.config.num_layers + 1  # qkv, o, gate_up, down per layer + tied head
    monkeypatch.setattr(kernels_module, "available", lambda: False)  # (the loader imports it when it loads)
    dense = load_decoder(smollm2_gguf, exact_numerics=True)
    assert not [m for m in dense.model.modules() if getattr(m, "qweight", None) is not None]
    ids = torch.tensor(quantized.tokenizer.encode("The capital of France is"))

    def logits(loaded):
        with torch.inference_mode(), forward_context(ForwardContext.no_cache([len(ids)])):
            return loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids))))

    assert torch.equal(logits(quantized), logits(dense))
