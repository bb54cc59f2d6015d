"""Four mixture-of-experts families added as one module each (runlm/models/families/{glm4_moe,dots1,ernie4_5_moe,
granitemoe}.py) over one router (runlm.models.moe.SparseMoeBlock.route): GLM-4.5 and dots1 route as DeepSeek-V3
(sigmoid scores, a choice bias, groups, renormalized and scaled weights, ungated shared experts, leading dense layers),
ERNIE 4.5 MoE by softmax with a choice bias, GraniteMoE by softmax inside Granite's multipliers. Each test model's
choice bias is random (zeros at init), so a router that ignores it fails: see tests/fixtures/models.py.

Exact mode within 1e-4 of transformers and its greedy tokens, from safetensors and from llama.cpp's converter's GGUF;
the routing read alike from both; fast mode on the converter's Q8_0 file held to llama.cpp's own KL on it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runlm.engine.llm import LLM
from runlm.formats.gguf import GGUFFile
from runlm.kernels import ggml
from runlm.models.config import ModelConfig
from runlm.models.evaluate import all_logits
from runlm.models.load import load_decoder
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.models.test_families import fast_mode_kl, matches_transformers
from tests.models.test_llama import _prompt

FAMILIES = {"glm4-moe": "glm4_moe", "dots1": "dots1", "ernie4_5-moe": "ernie4_5_moe", "granitemoe": "granitemoe"}
# llama.cpp's mean KL (llama-cpp-python 0.3.36, logits_all, one 512-token context) on the converter's Q8_0 file
# against exact mode on its f32 file, over the first 512 tokens of english_text() (its own f32 logits: <= 1e-3).
# runlm measured 0.0106, 0.0272, 0.0685 and 0.00294 (AMD EPYC, AVX-512).
LLAMA_CPP_Q8_0_KL = {"glm4-moe": 0.0128, "dots1": 0.0267, "ernie4_5-moe": 0.0691, "granitemoe": 0.00286}


@default_run("glm4-moe-safetensors", "dots1-safetensors", "ernie4_5-moe-safetensors", "granitemoe-safetensors", "glm4-moe-gguf")
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("recipe", FAMILIES)
def test_routed_experts_match_transformers(recipe: str, fmt: str, tiny_model) -> None:
    loaded = matches_transformers(recipe, fmt, tiny_model)
    assert loaded.config.family == FAMILIES[recipe]


# what each test model's config says (tests/fixtures/models.py), as ModelConfig holds it
EXPECTED = {
    "glm4-moe": dict(num_layers=3, moe_gating="sigmoid", moe_score_bias=True, moe_groups=2, moe_groups_used=1,
                     routed_scaling=2.5, norm_topk_prob=True, shared_expert_intermediate_size=32, dense_layers=[0],
                     qk_norm=True, attention_bias=True, partial_rotary_factor=0.5),
    "dots1": dict(num_layers=3, moe_gating="sigmoid", moe_score_bias=True, moe_groups=1, routed_scaling=1.5,
                  norm_topk_prob=False, shared_expert_intermediate_size=64, dense_layers=[0], qk_norm=True),
    "ernie4_5-moe": dict(num_layers=3, moe_gating="softmax", moe_score_bias=True, norm_topk_prob=True,
                         shared_expert_intermediate_size=64, dense_layers=[0], num_experts_per_tok=2),
    "granitemoe": dict(num_layers=2, moe_gating="softmax", moe_score_bias=False, norm_topk_prob=True,
                       shared_expert_intermediate_size=0, dense_layers=[], residual_scale=pytest.approx(0.4)),
}


@pytest.mark.parametrize("recipe", FAMILIES)
def test_the_routing_reads_alike_from_the_config_and_the_gguf_file(recipe: str, tiny_model) -> None:
    hf = ModelConfig.from_hf(json.loads((tiny_model(recipe) / "config.json").read_text()))
    gguf = ModelConfig.from_gguf(GGUFFile(converted_gguf(recipe)))
    for cfg in (hf, gguf):
        assert cfg.num_experts == 8
        for name, value in EXPECTED[recipe].items():
            assert getattr(cfg, name) == value, (name, getattr(cfg, name))
    assert gguf.routed_scaling == pytest.approx(hf.routed_scaling)


def test_multi_token_prediction_layers_are_not_the_decoders(tiny_model, tmp_path: Path) -> None:
    """GLM-4.5 and DeepSeek-V3 checkpoints carry their MTP layer past num_hidden_layers (the GGUF file counts it in
    block_count and says nextn_predict_layers: the test above reads 3 layers of its 4): loaded, it changes nothing."""
    source = tiny_model("glm4-moe")
    with_mtp = tmp_path / "glm4-moe"
    shutil.copytree(source, with_mtp)
    save_file({"model.layers.3.eh_proj.weight": torch.ones(64, 128),
               "model.layers.3.self_attn.q_proj.weight": torch.ones(64, 64)}, str(with_mtp / "mtp.safetensors"))
    ids = _prompt(49152, 40)
    plain, mtp = (load_decoder(path, exact_numerics=True) for path in (source, with_mtp))
    assert len(mtp.model.model.layers) == 3
    assert torch.equal(all_logits(plain.model, ids), all_logits(mtp.model, ids))


@default_run("glm4-moe")
@pytest.mark.skipif(not ggml.available(), reason="ggml's kernels are unavailable: fast mode is exact mode here")
@pytest.mark.parametrize("recipe", FAMILIES)
def test_fast_mode_kl_divergence_is_llama_cpps(recipe: str) -> None:
    fast = load_decoder(converted_gguf(recipe, "q8_0"))
    experts = fast.model.model.layers[-1].mlp.experts
    assert all(e.gate_up_proj.ggml and e.gate_up_proj.weight is None for e in experts)  # the file's blocks
    kl = fast_mode_kl(recipe, fast)
    assert 0 < kl < 1.25 * LLAMA_CPP_Q8_0_KL[recipe], f"fast mode's KL divergence {kl:.6f}"


def test_the_engine_serves_them_on_the_torch_runner_and_says_why() -> None:
    llm = LLM(str(converted_gguf("glm4-moe", "q8_0")), max_model_len=256, kv_cache_memory="16MiB")
    assert llm.engine.choice.describe() == "torch (the glm4_moe family)"
    assert llm.generate(["The capital of France is"])[0].outputs[0].token_ids


@pytest.mark.parametrize("recipe", FAMILIES)
def test_the_gpu_runner_runs_them(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from runlm.engine.runners.select import select_runner
    from runlm.engine.types.config import EngineConfig
    from runlm.models.spec import read_spec

    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1")  # (their tokens: tests/engine/test_gpu_runner)
    path = converted_gguf(recipe, "q8_0")
    assert select_runner(read_spec(path), EngineConfig(model=str(path))).kind.name == "gpu"
