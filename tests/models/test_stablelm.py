"""StableLM, a family added as one module (runlm/models/families/stablelm.py): Llama's layer with LayerNorm (random
weights and biases in the test models), partial rotary (a quarter of each head), q/k/v biases, and the parallel
residual as a second model. Exact mode within 1e-4 of transformers and its greedy tokens, from safetensors and from
llama.cpp's GGUF; per-head q/k LayerNorms refused by name; the GPU runner refusing the family by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runlm.formats import ModelFormatError
from runlm.models.llama import LayerNorm
from runlm.models.load import load_decoder
from tests.fixtures.default_run import default_run
from tests.models.test_families import matches_transformers


@default_run("safetensors-stablelm", "safetensors-stablelm-parallel")  # (each family's GGUF under make test-slow)
@pytest.mark.parametrize("recipe", ["stablelm", "stablelm-parallel"])
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_stablelm_matches_transformers(recipe: str, fmt: str, tiny_model) -> None:
    loaded = matches_transformers(recipe, fmt, tiny_model)
    cfg = loaded.config
    assert cfg.family == "stablelm" and cfg.rotary_dim == cfg.head_dim // 4
    assert cfg.parallel_residual == (recipe == "stablelm-parallel")
    assert isinstance(loaded.model.model.norm, LayerNorm)


def test_per_head_qk_layernorms_are_refused_by_name(tiny_model, tmp_path: Path) -> None:
    source = tiny_model("stablelm")
    shutil.copytree(source, tmp_path / "m")
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "qk_layernorm": True}))
    with pytest.raises(ModelFormatError, match="qk_layernorm"):
        load_decoder(tmp_path / "m", exact_numerics=True)
