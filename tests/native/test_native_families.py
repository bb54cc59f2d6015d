"""The native runner on the families beyond Llama's (issue 30): Gemma 2/3 (embedding scale, sandwich norms,
attention and final soft-caps, sliding-window layers in a KV group of their own, Gemma 3's local RoPE base) and
Phi-3 (LongRoPE past original_max_position_embeddings, partial rotary) compute what the torch fast path computes
on the same GGUF file: greedy tokens identical, logprobs within a stated tolerance. Gemma 3 is bit for bit (the torch
model's fused loop computes it with the same kernels); Gemma 2's final soft-cap is numpy's tanh against torch's (a
few ulps: 1e-5); Phi-3's torch model computes its layers op by op (LongRoPE and partial rotary are not fused there),
whose norms sum in float where the native ones sum in double: bit for bit on q8_0 files here, within 1e-2 on f16
files (F16 weights take fp16 activations, which turn those last-bit differences into ~1e-3). OLMoE's q/k norms over
the whole projection (the decoder's ``LayerFamily.qk_norm_whole``) against the torch layer's own.

The f32 GGUFs run on torch for every family (the native kernels take no F32 matrices), so q8_0 and f16 files here."""
from __future__ import annotations

import numpy as np
import pytest

from runlm.engine.core.kv_groups import HybridBlockManager
from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from runlm.native import kernels
from runlm.native.library import lib, ok
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.native.engines import native_and_torch

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")

KW = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory="64MiB", max_model_len=512)
# longer than the Gemma fixtures' window (16) and Phi-3's original_max_position_embeddings (64), in chunks of 64
LONG = "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories. " * 4
PROMPTS = ["The capital of France is", "def fibonacci(n):", LONG]


def _engines(path: str) -> tuple[LLM, LLM]:
    return native_and_torch(path, **KW)


TOLERANCE = {("gemma2", "q8_0"): 1e-5, ("gemma3", "q8_0"): 0.0, ("phi3", "q8_0"): 0.0, ("gemma3", "f16"): 0.0,
             ("phi3", "f16"): 1e-2, ("smollm3", "q8_0"): 0.0, ("ernie4_5", "q8_0"): 0.0,
             ("glm4", "q8_0"): 0.0}


@default_run("gemma3-q8_0", "phi3-f16", "glm4-q8_0")
@pytest.mark.parametrize(("recipe", "fmt"), list(TOLERANCE))
def test_family_matches_the_torch_fast_path(recipe: str, fmt: str) -> None:
    native, fused = _engines(str(converted_gguf(recipe, fmt)))
    cfg = native.engine.loaded.config
    if recipe.startswith("gemma"):  # global and sliding-window layers: two KV groups, the window's own slots
        assert isinstance(native.engine.blocks, HybridBlockManager)
    assert len(native.get_tokenizer().encode(LONG)) > max(64, cfg.sliding_window or 0)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    ours, theirs = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in (native, fused))
    diff = 0.0
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for mine, ref in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(mine) == set(ref)
            diff = max(diff, *(abs(mine[t].logprob - ref[t].logprob) for t in mine))
    assert diff <= TOLERANCE[recipe, fmt]
    # a batch of the prompts equals each prompt run alone (the window group's slots are per sequence)
    alone = [native.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[1:]]
    assert alone == [o.outputs[0].token_ids for o in ours[1:]]
    if recipe == "gemma2" and fmt == "q8_0":  # weights reloaded (sleep level 2): the layers' KV groups set again
        native.engine.sleep(2)
        native.engine.wake_up()
        assert native.generate([LONG], params, use_tqdm=False)[0].outputs[0].token_ids == ours[2].outputs[0].token_ids


def test_whole_projection_qk_norms_match_the_torch_layer() -> None:
    """OLMoE's q/k RMSNorm over the whole projection (weights [H D] and [KVH D]) before RoPE, on a Llama file whose
    layers get random whole-projection norms: the native step against the torch model's per-op layers."""
    import torch

    from runlm.models.llama import RMSNorm
    from runlm.models.load import load_decoder
    from tests.native.test_decoder import SLOTS, Step, decoder_of

    model = load_decoder(converted_gguf("llama", "q8_0")).model
    model.model.fused = False  # the per-op layers: Attention.forward's qk_norm_whole branch
    decoder = decoder_of(model)  # without q/k norms: its layers are rebuilt below with the whole ones
    torch.manual_seed(0)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_norm, attn.k_norm = RMSNorm(attn.q_size, 1e-5), RMSNorm(attn.kv_size, 1e-5)
        attn.qk_norm = attn.qk_norm_whole = True
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.data = 1.0 + 0.5 * torch.randn_like(norm.weight)
    layers = [kernels.DecoderLayer(**{**vars(nl), "q_norm": layer.self_attn.q_norm.weight.detach().numpy(),
                                      "k_norm": layer.self_attn.k_norm.weight.detach().numpy(),
                                      "family": kernels.LayerFamily(qk_norm_whole=True)})
              for nl, layer in zip(decoder.layers, model.model.layers)]
    first = model.model.layers[0]
    decoder = kernels.Decoder(decoder.hidden, decoder.heads, decoder.kv_heads, decoder.head_dim,
                              first.input_layernorm.eps, first.self_attn.rope.interleaved,
                              model.model.embed_tokens.ggml.raw.numpy(), model.model.embed_tokens.ggml.qtype,
                              model.model.norm.weight.detach().numpy(), layers)
    kvh, d = decoder.kv_heads, decoder.head_dim
    decoder.set_kv_caches([(np.zeros((SLOTS, kvh, d), np.float32), np.zeros((SLOTS, kvh, d), np.float32))
                           for _ in layers])
    theirs = [(torch.zeros(SLOTS, kvh, d), torch.zeros(SLOTS, kvh, d)) for _ in layers]
    for step in (Step([(list(range(100, 111)), 0, list(range(32)))]), Step([([7], 11, list(range(32)))])):
        mine, ref = step.native(decoder), step.torch(model, theirs)
        assert np.isfinite(mine).all()
        np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-4)
    with_per_head = [kernels.DecoderLayer(**{**vars(nl), "q_norm": np.ones(d, np.float32)}) for nl in layers]
    with pytest.raises(ValueError, match="q_norm"):  # a whole-projection layer's norm must span the projection
        kernels.Decoder(decoder.hidden, decoder.heads, decoder.kv_heads, d, 1e-5, False,
                        model.model.embed_tokens.ggml.raw.numpy(), model.model.embed_tokens.ggml.qtype,
                        model.model.norm.weight.detach().numpy(), with_per_head)


def test_a_layer_in_a_kv_group_needs_the_groups_slots() -> None:
    native = LLM(str(converted_gguf("gemma2", "q8_0")), **KW)
    decoder = native.engine.loaded.model.decoder
    ids = np.array([1, 2], np.int64)
    args = (ids, np.arange(2, dtype=np.int64), np.arange(2, dtype=np.int64), np.array([2], np.int64),
            np.array([2], np.int64), np.arange(2, dtype=np.int64), np.empty((2, decoder.hidden), np.float32))
    with pytest.raises(ValueError, match="no slots given for KV group 1"):
        decoder.forward(*args)
    with pytest.raises(ValueError, match="outside the cache"):
        decoder.forward(*args, groups=(np.array([[0, 10**9]], np.int64), np.array([[0, 1]], np.int64)))
    with pytest.raises(ValueError, match="rotary features must be even"):
        ok(lib().runlm_decoder_set_layer_family(decoder.handle, 0, 3, 0, 0))
    with pytest.raises(ValueError, match="1 KV groups for 2 layers"):
        decoder.set_layer_groups([0])


def test_gemma3_with_images_stays_on_the_torch_runner() -> None:
    """Gemma 3's text model attends bidirectionally among an image's tokens, which the native runner does not: with
    its mmproj the file runs on torch, and the reason is the tower's."""
    from tests.fixtures.vlm.gguf import vlm_gguf

    text, mmproj = vlm_gguf("gemma3", "q8_0")
    llm = LLM(str(text), mmproj=str(mmproj), max_model_len=512, kv_cache_memory="64MiB")
    assert not llm.engine.native and llm.engine.modalities == ("text", "image")
    assert llm.engine.choice.reasons == ("bidirectional attention among an image's tokens",)


def test_a_safetensors_directory_is_refused_what_only_the_gguf_loader_builds(tiny_model) -> None:
    """runlm.models.native_safetensors builds the Llama layer only: Phi-3's LongRoPE and partial rotary, which the
    GGUF loader builds, are named as its reason there (and Gemma's family)."""
    from runlm.formats.safetensors import SafetensorsDir, read_hf_config
    from runlm.models.config import ModelConfig
    from runlm.models.native_safetensors import why_not_native_dir

    for recipe, reason in (("phi3", "partial rotary or LongRoPE"), ("gemma3", "the gemma3 family")):
        path = tiny_model(recipe)
        hf = read_hf_config(path)
        assert why_not_native_dir(SafetensorsDir(path), ModelConfig.from_hf(hf), hf) == reason


def test_longrope_rows_take_the_long_table_past_the_original_context() -> None:
    """Phi-3's tables stacked (short rows 0..L-1, long rows L..2L-1): a sequence whose context passes
    original_max_position_embeddings (64 here) rotates every row by the long table, the others stay short."""
    from runlm.models.native import load_native

    loaded = load_native(converted_gguf("phi3", "q8_0"), 256)
    assert loaded is not None
    model = loaded.model
    assert model.long_rope_after == 64 and model.rope_len == 256
    assert model.decoder is not None and model.decoder.layers[0].cos.shape == (512, 8)  # half of 16 rotated
    positions = np.array([63, 64, 10], np.int64)  # sequence a: 2 rows (context 65), sequence b: 1 row (context 11)
    assert model.rope_positions(positions, [2, 1], [65, 11]).tolist() == [63 + 256, 64 + 256, 10]
    assert model.rope_positions(positions[:1], [1], [64]).tolist() == [63]
    with pytest.raises(ValueError, match="past the rope table"):
        model.rope_positions(np.array([256], np.int64), [1], [257])
