"""Seed-OSS, a family added as one module (runlm/models/families/seed_oss.py): Llama's layer with q/k/v biases and
none on o_proj (the test model's biases random, so a bias dropped or misplaced shows). Exact mode within 1e-4 of
transformers and its greedy tokens, from safetensors and from llama.cpp's GGUF; the native runner equal to the
torch fast path on the Q8_0 file; a checkpoint asking for an o_proj bias refused by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runlm.engine.types.sampling_params import SamplingParams
from runlm.formats import ModelFormatError
from runlm.models.config import ModelConfig
from runlm.models.load import load_decoder
from runlm.native import kernels
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.models.test_families import matches_transformers
from tests.models.test_llama import _prompt
from tests.native.engines import native_and_torch


@default_run("safetensors")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_seed_oss_matches_transformers(fmt: str, tiny_model) -> None:
    cfg = matches_transformers("seed-oss", fmt, tiny_model).config
    assert cfg.family == "seed_oss" and cfg.attention_bias and not cfg.o_proj_bias


@pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")
def test_the_native_runner_gives_the_torch_fast_paths_tokens_and_logprobs() -> None:
    native, fused = native_and_torch(str(converted_gguf("seed-oss", "q8_0")), max_model_len=256,
                                     kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": _prompt(49152, n, seed=n)} for n in (9, 40)]
    for a, b in zip(native.generate(prompts, params), fused.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for mine, ref in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(mine) == set(ref) and all(abs(mine[t].logprob - ref[t].logprob) <= 1e-5 for t in mine)


def test_an_o_proj_bias_is_refused_by_name(tiny_model, tmp_path: Path) -> None:
    source = tiny_model("seed-oss")
    config = {**json.loads((source / "config.json").read_text()), "attention_out_bias": True}
    shutil.copytree(source, tmp_path / "with-o-bias")
    (tmp_path / "with-o-bias" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="attention_out_bias"):
        ModelConfig.from_hf(config)
    with pytest.raises(ModelFormatError, match="attention_out_bias"):
        load_decoder(tmp_path / "with-o-bias")
