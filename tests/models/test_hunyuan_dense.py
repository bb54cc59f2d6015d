"""Hunyuan dense, a family added as one module (runlm/models/families/hunyuan_dense.py): per-head q/k norms after
RoPE (ModelConfig.qk_norm_after_rope), its checkpoint names mapped (Family.hf_tensor_names). Exact mode within 1e-4
of transformers and its greedy tokens, from safetensors and from llama.cpp's GGUF; its RoPE "dynamic" with a fixed
alpha read as transformers reads it; the runner choice naming why the native runner does not run it."""
from __future__ import annotations

import json

import pytest
import torch

from runlm.engine.llm import LLM
from runlm.models.config import ModelConfig
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.models.test_families import matches_transformers


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_hunyuan_dense_matches_transformers(fmt: str, tiny_model) -> None:
    cfg = matches_transformers("hunyuan-dense", fmt, tiny_model).config
    assert cfg.family == "hunyuan_dense" and cfg.qk_norm and cfg.qk_norm_after_rope


def test_the_ntk_alpha_rope_is_transformers(tiny_model) -> None:
    from transformers import AutoConfig
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding

    hf = json.loads((tiny_model("hunyuan-dense") / "config.json").read_text())
    hf["rope_parameters"] = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}
    ours = ModelConfig.from_hf(hf)
    assert ours.rope_scaling is None
    theirs = HunYuanDenseV1RotaryEmbedding(AutoConfig.for_model(**hf)).inv_freq
    d = ours.head_dim
    mine = 1.0 / ours.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=0)


def test_fast_mode_runs_on_the_torch_runner_and_says_why() -> None:
    llm = LLM(str(converted_gguf("hunyuan-dense", "q8_0")), max_model_len=256, kv_cache_memory="16MiB")
    assert llm.engine.choice.describe() == "torch (q/k norms after RoPE)"
    assert llm.generate(["The capital of France is"])[0].outputs[0].token_ids
