"""DeepSeek-V2 and V3 (runlm/models/families/deepseek.py): multi-head latent attention over a cache of latents
(runlm/models/mla.py) and DeepSeek's experts. Exact mode within 1e-4 of transformers and its greedy tokens through the
engine (whose cache holds the latents), from safetensors and from llama.cpp's converter's ``deepseek2`` GGUF (its
split, transposed ``attn_k_b``/``attn_v_b``, YaRN's log multiplier); the cache's size per token; fast mode held to
llama.cpp's KL on the same Q8_0 file (prefix reuse and batch invariance: tests/models/test_families.py)."""
from __future__ import annotations

import pytest

from runlm.engine.llm import LLM
from runlm.kernels import ggml
from runlm.models.config import ModelConfig
from runlm.store.inspect import inspect_model
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.models.test_families import fast_mode_kl, matches_transformers

RECIPES = ("deepseek-v2", "deepseek-v3")
# Fast mode's mean KL on the converter's Q8_0 file against exact mode on its f32 file, first 512 tokens of
# english_text(). llama.cpp (llama-cpp-python 0.3.36, logits_all, one context) scores 0.0381 on V3's (its f32 logits:
# 1e-5); runlm 0.0383. llama.cpp reads a DeepSeek-V2 file without q_lora_rank only at V2-Lite's 27 layers, so V2's
# bound is runlm's own 0.0335 (AMD EPYC, AVX-512), with the same margin.
Q8_0_KL = {"deepseek-v2": 0.0335, "deepseek-v3": 0.0381}


@default_run("deepseek-v2-safetensors", "deepseek-v3-gguf")
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_latent_attention_matches_transformers(recipe: str, fmt: str, tiny_model) -> None:
    cfg = matches_transformers(recipe, fmt, tiny_model).config
    assert cfg.family == "deepseek" and cfg.kv_lora_rank == 16 and cfg.qk_rope_head_dim == 8
    assert cfg.head_dim == 24 and cfg.v_head_dim == 16 and cfg.q_lora_rank == (24 if recipe == "deepseek-v3" else 0)
    v3 = recipe == "deepseek-v3"
    assert (cfg.moe_gating, cfg.moe_score_bias, cfg.moe_groups) == (("sigmoid", True, 2) if v3 else ("softmax", False, 1))
    assert cfg.num_layers == 3 and cfg.dense_layers == [0]
    if v3:
        assert cfg.rope_scaling and cfg.rope_scaling["mscale_all_dim"] == pytest.approx(1.0)


def test_the_cache_holds_one_latent_per_token_and_layer(tiny_model) -> None:
    path = tiny_model("deepseek-v3")
    llm = LLM(str(path), exact_numerics=True, max_model_len=256, kv_cache_memory="4MiB")
    k, v = llm.engine.runner.kv_caches[0]
    assert k.shape[1:] == (1, 16 + 8) and v.shape[1:] == (1, 0)
    assert llm.engine.kv_bytes_per_token == 3 * 24 * 4  # 3 layers, one 24-value fp32 row each
    # the store's estimate before loading says the same, from the directory and from the GGUF file
    assert inspect_model(path).kv_cache_bytes_per_token() == llm.engine.kv_bytes_per_token
    assert inspect_model(converted_gguf("deepseek-v3")).kv_cache_bytes_per_token() == llm.engine.kv_bytes_per_token


def test_deepseek_v2_lites_cache_is_under_an_eighth_of_per_head_k_and_v() -> None:
    cfg = ModelConfig.from_hf({  # DeepSeek-V2-Lite's config.json, its shapes
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "topk_method": "greedy"})
    heads, k_dim, v_dim = cfg.kv_cache_shape
    per_head = cfg.num_heads * (cfg.head_dim + cfg.v_head_dim)  # 16 x (192 + 128)
    assert heads * (k_dim + v_dim) == 576 and heads * (k_dim + v_dim) <= per_head / 8


@default_run("deepseek-v3")
@pytest.mark.skipif(not ggml.available(), reason="ggml's kernels are unavailable: fast mode is exact mode here")
@pytest.mark.parametrize("recipe", RECIPES)
def test_fast_mode_kl_divergence_is_llama_cpps(recipe: str) -> None:
    kl = fast_mode_kl(recipe)
    assert 0 < kl < 1.25 * Q8_0_KL[recipe], f"fast mode's KL divergence {kl:.6f}"


def test_the_gpu_runner_keeps_the_latents_and_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU runner (RUNLM_GPU_RUNNER=1, on the CPU: the backend's reference attention; the Triton kernel on
    latents is tests/kernels/test_gpu_triton_attention.py's) the paged cache holds one latent row a token as one
    KV head, K and V the same tensor, and the greedy tokens are the torch runner's (a Q8_0 file: its W_UK/W_UV held
    dense on the device, its other matrices in their blocks), prefilled in chunks, then decoded."""
    from runlm.engine.runners.gpu import GPURunner
    from runlm.engine.types.sampling_params import SamplingParams
    from tests.engine.conftest import prompt_ids

    path = converted_gguf("deepseek-v3", "q8_0")
    prompts = [{"prompt_token_ids": prompt_ids(7 + 13 * i, seed=i)} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kw = dict(block_size=4, max_num_batched_tokens=16, kv_cache_memory="4MiB", exact_numerics=True, max_model_len=256)
    got = {}
    for gpu in (True, False):
        monkeypatch.setenv("RUNLM_GPU_RUNNER", "1" if gpu else "0")
        llm = LLM(str(path), **kw)
        got[gpu] = [c.token_ids for o in llm.generate(prompts, params) for c in o.outputs]
        if gpu:
            assert isinstance(llm.engine.runner, GPURunner)
            k, v = llm.engine.runner.backend.caches[0]
            assert k is v and k.shape[1:] == (4, 1, 16 + 8)
    assert got[True] == got[False]
