"""Hybrid decoders with Mamba2 layers (runlm/models/mamba2.py) and the recurrent state the engine keeps for them:
one state slot per running sequence beside the paged KV cache of the attention layers (runlm/engine/core/kv_cache.py
``state_slots``), taken on admission and given back with the blocks; prefix caching off (a state is not a prefix's);
a preempted sequence recomputes its state from its tokens; speculative decoding refused.

Each family: exact mode within 1e-4 of transformers (whose Mamba2 reference is its torch path) and its greedy tokens,
from safetensors and from llama.cpp's converter's GGUF; fast mode on the converter's Q8_0 file held to llama.cpp's KL.
Through the engine: a batch of prompts (one a single token) under chunked prefill and preemption gives transformers'
greedy tokens for each."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from runlm.formats.gguf import GGUFFile
from runlm.kernels import ggml
from runlm.models.config import ModelConfig
from runlm.models.gated_delta import gated_delta_scan
from runlm.models.linear import Linear
from runlm.models.load import load_decoder
from runlm.models.mamba2 import ssd_scan
from runlm.store.metadata import inspect_gguf, inspect_safetensors_dir
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.fixtures.models import HYBRID_RECIPES
from tests.models.test_families import fast_mode_kl
from tests.models.test_llama import GREEDY_TOKENS, RTOL, _our_logits, _prompt

# recipe (tests.fixtures.models.HYBRID_RECIPES) -> its family from safetensors, and from the GGUF file llama.cpp's
# converter writes of it (None: the converter does not write one -- MiniMax's reads the remote-code checkpoints only)
FAMILIES = {"granitemoehybrid": ("granitemoehybrid", "granitemoehybrid"), "bamba": ("bamba", "granitemoehybrid"),
            "nemotron-h": ("nemotron_h", "nemotron_h"), "nemotron-h-moe": ("nemotron_h", "nemotron_h"),
            "mamba2": ("mamba2", "mamba2"), "lfm2": ("lfm2", "lfm2"), "qwen3-next": ("qwen3_next", "qwen3_next"),
            "falcon-h1": ("falcon_h1", "falcon_h1"), "minimax": ("minimax", None)}
# Fast mode's bound on the converter's Q8_0 file: mean KL against exact mode on its f32 file over the first 512 tokens
# of english_text(). Granite 4: 1.25x llama.cpp's own (llama-cpp-python 0.3.36, logits_all, one 512-token context:
# 0.001466; on the f32 file 8e-9; runlm measured 0.001465, AMD EPYC, AVX-512). Bamba: llama.cpp is no reference --
# its converter permutes whole heads and its graph then rotates neighbouring features where transformers rotates
# Bamba's half-head pairs (KL 0.708 on the f32 file) -- so the bound is absolute: exact mode on the Q8_0 weights
# alone measures 0.0128, fast mode 0.0255. Nemotron-H: llama.cpp 0.002451 (on the f32 file 3.3e-5; runlm 0.002435),
# with experts 0.01771 (f32: 2.8e-4; runlm 0.01751). Mamba2: llama.cpp 0.01033 (f32: 5e-12; runlm 0.01032). LFM2:
# llama.cpp 0.01614 (f32: 1.5e-9; runlm 0.01607). Qwen3-Next: llama.cpp 0.07887 (f32: 2e-9; runlm 0.07856; the
# random router's near ties, as the other mixtures'). Falcon-H1: llama.cpp 0.006268 (f32: 2.5e-8; runlm 0.006181).
FAST_KL_BOUND = {"granitemoehybrid": 1.25 * 0.001466, "bamba": 0.035, "nemotron-h": 1.25 * 0.002451,
                 "nemotron-h-moe": 1.25 * 0.01771, "mamba2": 1.25 * 0.01033, "lfm2": 1.25 * 0.01614,
                 "qwen3-next": 1.25 * 0.07887, "falcon-h1": 1.25 * 0.006268}
# what each test model's config says (tests/fixtures/models.py), as ModelConfig holds it
EXPECTED = {
    "granitemoehybrid": dict(recurrent_layers=[0, 2, 3], kv_layers=[1], ssm_heads=8, ssm_head_dim=16, ssm_state=16,
                             ssm_groups=2, ssm_conv_kernel=4, nope_layers=[0, 1, 2, 3], num_kv_heads=2,
                             shared_expert_intermediate_size=96, residual_scale=pytest.approx(0.4)),
    "bamba": dict(recurrent_layers=[0, 2], kv_layers=[1], ssm_heads=8, ssm_head_dim=16, ssm_state=16, ssm_groups=1,
                  nope_layers=[], num_kv_heads=2, partial_rotary_factor=0.5, num_experts=0, residual_scale=1.0),
    "nemotron-h": dict(recurrent_layers=[0, 2], mlp_layers=[1, 4], kv_layers=[3], nope_layers=[0, 1, 2, 3, 4],
                       num_experts=0, intermediate_size=128, hidden_act="relu2", gated_mlp=False, ssm_groups=2,
                       ssm_dt_limit=(0.001, float("inf"))),
    "nemotron-h-moe": dict(recurrent_layers=[0, 4], mlp_layers=[1, 3, 5], kv_layers=[2], dense_layers=[0, 2, 4],
                           num_experts=8, num_experts_per_tok=2, expert_size=32, shared_expert_intermediate_size=48,
                           moe_gating="sigmoid", moe_score_bias=True, moe_groups=2, moe_groups_used=1,
                           routed_scaling=2.5, norm_topk_prob=True, gated_mlp=False),
    "mamba2": dict(recurrent_layers=[0, 1, 2], kv_layers=[], mlp_layers=[], ssm_heads=8, ssm_groups=2,
                   tie_word_embeddings=True),
    "lfm2": dict(recurrent_layers=[0, 1, 3, 4], kv_layers=[2, 5], recurrent_kind="short_conv", ssm_conv_kernel=3,
                 ssm_conv_bias=False, qk_norm=True, intermediate_size=128, tie_word_embeddings=True,
                 state_shapes=((64, 2), (0, 0, 0))),
    "qwen3-next": dict(recurrent_layers=[0, 1, 2], kv_layers=[3], recurrent_kind="gated_delta", attn_output_gate=True,
                       ssm_heads=4, ssm_groups=2, ssm_head_dim=16, ssm_state=16, num_experts=8,
                       shared_expert_intermediate_size=48, partial_rotary_factor=0.25, qk_norm=True,
                       state_shapes=((128, 3), (4, 16, 16))),
    "falcon-h1": dict(recurrent_layers=[0, 1], kv_layers=[0, 1], parallel_mixers=True, ssm_heads=8, ssm_head_dim=16,
                      ssm_groups=2, ssm_norm="none", num_kv_heads=2),
    "minimax": dict(recurrent_layers=[0, 1, 2], kv_layers=[3], recurrent_kind="lightning", ssm_heads=4,
                    ssm_head_dim=16, ssm_state=16, num_experts=4, state_shapes=((0, 0), (4, 16, 16))),
}
GGUF_RECIPES = [r for r, (_, in_gguf) in FAMILIES.items() if in_gguf]
assert set(FAMILIES) == set(HYBRID_RECIPES)


# (the default run: every family from safetensors, two from llama.cpp's GGUF; the rest under make test-slow)
@default_run(*(f"{r}-safetensors" for r in FAMILIES), "nemotron-h-moe-gguf", "qwen3-next-gguf")
@pytest.mark.parametrize(("recipe", "fmt"), [
    (r, fmt) for r in FAMILIES for fmt in ("safetensors", "gguf") if fmt == "safetensors" or r in GGUF_RECIPES])
def test_hybrids_match_transformers(recipe: str, fmt: str, tiny_model) -> None:
    """Exact mode's logits within 1e-4 of transformers' on a 200-token prompt, and 64 greedy tokens through the engine
    that are transformers' own choices: each the argmax of its forward over the prompt and the tokens before it.
    (Not its cached decode's: Nemotron-H's decode skips the step-size clamp its prefill applies, and on the test
    model one step's two best logits lie 0.0016 apart.)"""
    source = tiny_model(recipe)
    loaded = load_decoder(source if fmt == "safetensors" else converted_gguf(recipe), exact_numerics=True)
    assert loaded.config.family == FAMILIES[recipe][fmt == "gguf"]
    ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = _prompt(loaded.config.vocab_size, 200)
    with torch.inference_mode():
        theirs = ref(torch.tensor([ids])).logits[0]
    ours = _our_logits(loaded, ids)
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < RTOL
    llm = LLM(str(loaded.path), block_size=4, kv_cache_memory="64MiB", max_model_len=1024, exact_numerics=True)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    greedy = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    with torch.inference_mode():
        chosen = ref(torch.tensor([ids + greedy])).logits[0, len(ids) - 1:-1].argmax(-1).tolist()
    assert greedy == chosen


@default_run("nemotron-h-moe", "qwen3-next", "mamba2", "minimax")
@pytest.mark.parametrize("recipe", FAMILIES)
def test_the_layers_read_alike_from_the_config_and_the_gguf_file(recipe: str, tiny_model) -> None:
    hf = ModelConfig.from_hf(json.loads((tiny_model(recipe) / "config.json").read_text()))
    files = [converted_gguf(recipe)] if recipe in GGUF_RECIPES else []
    configs = [hf, *(ModelConfig.from_gguf(GGUFFile(f)) for f in files)]
    for cfg in configs:
        for name, value in EXPECTED[recipe].items():
            assert getattr(cfg, name) == value, (name, getattr(cfg, name))
    # the store's memory estimate counts the K/V of the attention layers alone, as the engine allocates it
    for info in (*(inspect_gguf(f) for f in files), inspect_safetensors_dir(tiny_model(recipe))):
        assert info.num_layers == len(hf.kv_layers)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model(recipe))
    choice_biases = sum(b.numel() for n, b in reference.named_buffers() if n.endswith("e_score_correction_bias"))
    assert {cfg.num_params for cfg in configs} == {sum(p.numel() for p in reference.parameters()) + choice_biases}


# the default run bounds one pure Mamba2 model and one hybrid with experts; `make test-slow` every recipe (~9 s each)
@default_run("mamba2", "nemotron-h-moe")
@pytest.mark.skipif(not ggml.available(), reason="ggml's kernels are unavailable: fast mode is exact mode here")
@pytest.mark.parametrize("recipe", GGUF_RECIPES)
def test_fast_mode_kl_divergence_is_llama_cpps(recipe: str) -> None:
    fast = load_decoder(converted_gguf(recipe, "q8_0"))
    linears = [m for m in fast.model.model.layers[0].mixer.modules() if isinstance(m, Linear)]
    assert linears and all(m.ggml and m.weight is None for m in linears)  # the file's blocks
    kl = fast_mode_kl(recipe, fast)
    assert 0 < kl < FAST_KL_BOUND[recipe], f"fast mode's KL divergence {kl:.6f}"


def test_the_chunked_scan_is_the_recurrence_step_by_step() -> None:
    """ssd_scan's chunks (a quadratic form within, the state across) against h_t = exp(dt A) h + dt x B^T one step at
    a time, from a nonzero state, over lengths that end inside a chunk."""
    g = torch.Generator().manual_seed(0)
    b, length, heads, p, n = 2, 21, 3, 4, 5
    x, B, C = (torch.randn(b, length, heads, d, generator=g) for d in (p, n, n))
    dt = torch.rand(b, length, heads, generator=g)
    A = -torch.rand(heads, generator=g) * 2
    state = torch.randn(b, heads, p, n, generator=g)
    y, final = ssd_scan(x, dt, A, B, C, state, chunk=8)
    h, ys = state.clone(), []
    for t in range(length):
        h = h * torch.exp(dt[:, t] * A)[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]))
    assert torch.allclose(y, torch.stack(ys, 1), atol=1e-5) and torch.allclose(final, h, atol=1e-5)


def test_the_chunked_delta_rule_is_the_recurrence_step_by_step() -> None:
    """gated_delta_scan's chunks (the updates within a chunk as one triangular solve) against the gated delta rule one
    step at a time -- S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q -- from a nonzero state."""
    g0 = torch.Generator().manual_seed(0)
    b, length, heads, dk, dv = 2, 21, 3, 4, 5
    q, k = (torch.nn.functional.normalize(torch.randn(b, length, heads, dk, generator=g0), dim=-1) for _ in range(2))
    v = torch.randn(b, length, heads, dv, generator=g0)
    g, beta = -torch.rand(b, length, heads, generator=g0), torch.rand(b, length, heads, generator=g0)
    state = torch.randn(b, heads, dk, dv, generator=g0)
    out, final = gated_delta_scan(q, k, v, g, beta, state, chunk=8)
    s, outs = state.clone(), []
    for t in range(length):
        s = s * torch.exp(g[:, t])[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t]))
        s = s + k[:, t, :, :, None] * delta[:, :, None]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    assert torch.allclose(out, torch.stack(outs, 1), atol=1e-5) and torch.allclose(final, s, atol=1e-5)


def _transformers_choices(ref, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and each of ``tokens``: the argmax of its forward over them."""
    with torch.inference_mode():
        return ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()


@default_run("granitemoehybrid", "qwen3-next", "lfm2", "minimax")
@pytest.mark.parametrize("recipe", FAMILIES)
def test_the_engine_keeps_each_sequences_state_through_chunks_batches_and_preemption(recipe: str, tiny_model) -> None:
    path = tiny_model(recipe)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [_prompt(49152, n, seed=n) for n in (40, 1, 90, 150)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # 16 tokens a step: prompts in chunks, decode rows beside them; two sequences at a time, and a cache of 64 blocks
    # of 4 holds one long sequence, not the two longest: sequences are preempted and recompute their states (Mamba2
    # alone keeps no K/V: its blocks only count positions, every sequence at full length, and nothing is preempted)
    attention = len(EXPECTED[recipe]["kv_layers"])
    llm = LLM(str(path), exact_numerics=True, block_size=4, max_num_batched_tokens=16, max_model_len=512,
              max_num_seqs=2, kv_cache_memory=64 * 4 * 256 * max(attention, 1))
    engine = llm.engine
    assert engine.kv_bytes_per_token == 256 * attention  # each attention layer's K and V: 2 heads of 16, float32
    assert not engine.blocks.enable_prefix_caching
    assert [k.shape[0] for k, _ in engine.runner.kv_caches] == [256 if i in EXPECTED[recipe]["kv_layers"] else 0
                                                                for i in range(engine.loaded.config.num_layers)]
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert outs == [_transformers_choices(ref, p, o) for p, o in zip(prompts, outs)]
    assert (engine.num_preemptions > 0) == bool(attention)
    assert sorted(engine.blocks.free_states) == [0, 1]  # every slot given back
    # the same prompt again finds no cached prefix, and the slot it is given held another sequence's state
    again = llm.generate([{"prompt_token_ids": prompts[2]}], params)[0].outputs[0].token_ids
    assert again == outs[2]


def test_the_states_memory_does_not_grow_with_the_context_and_the_budget_bounds_their_number(tiny_model) -> None:
    """A state per running sequence, its size the model's alone: the same tensors at a context of 256 and of 2048;
    as many of them as kv_cache_memory holds (max_num_seqs at most), more sequences waiting their turn."""
    path = str(tiny_model("granitemoehybrid"))
    shapes = []
    for context in (256, 2048):
        llm = LLM(path, exact_numerics=True, max_model_len=context, kv_cache_memory="16MiB")
        states = llm.engine.runner.states
        shapes.append([None if s is None else (tuple(s[0].shape), tuple(s[1].shape)) for s in states])
        assert llm.engine.blocks.state_slots == llm.engine.config.max_num_seqs
    assert shapes[0] == shapes[1]
    per_seq = llm.engine.loaded.config.state_bytes_per_seq  # 3 layers' conv [192, 3] and SSM [8, 16, 16] states
    assert per_seq == 3 * 4 * (192 * 3 + 8 * 16 * 16)
    small = LLM(path, exact_numerics=True, max_model_len=256, kv_cache_memory=3 * per_seq)
    assert small.engine.blocks.state_slots == 3
    prompts = [{"prompt_token_ids": _prompt(49152, 20, seed=s)} for s in range(5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert together == [small.generate([p], params)[0].outputs[0].token_ids for p in prompts]


@default_run("mamba2")
@pytest.mark.parametrize("recipe", FAMILIES)
def test_speculative_decoding_is_refused_by_name(recipe: str, tiny_model) -> None:
    with pytest.raises(ValueError, match="recurrent layers keep one state per sequence"):
        LLM(str(tiny_model(recipe)), kv_cache_memory="16MiB", max_model_len=256,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3})


@default_run("nemotron-h-moe", "qwen3-next", "minimax")
@pytest.mark.parametrize("recipe", FAMILIES)
def test_the_runners_say_why_not(recipe: str, monkeypatch: pytest.MonkeyPatch, tiny_model) -> None:
    from runlm.engine.runners.select import select_runner
    from runlm.engine.types.config import EngineConfig
    from runlm.models.spec import read_spec

    path = converted_gguf(recipe, "q8_0") if recipe in GGUF_RECIPES else tiny_model(recipe)
    llm = LLM(str(path), max_model_len=256, kv_cache_memory="16MiB")
    assert llm.engine.choice.describe() == f"torch (the {FAMILIES[recipe][recipe in GGUF_RECIPES]} family's recurrent " \
        "layers, a state per sequence the native runner does not keep)"
    assert llm.generate(["The capital of France is"])[0].outputs[0].token_ids
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1")  # (the GPU runner keeps a state per sequence too: eager)
    assert select_runner(read_spec(path), EngineConfig(model=str(path))).kind.name == "gpu"
