"""diffusers pipeline directories in the store: what show reports, which weights count, which files a pull takes."""
from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import pytest

from runlm.formats import ModelFormatError
from runlm.store import ModelStore
from runlm.store.inspect import inspect_model
from runlm.store.sources import DIFFUSERS_PATTERNS, HF_PATTERNS, hf_patterns, resolve_source


def test_a_pipeline_directory_is_described_by_its_index(tiny_sd: Path) -> None:
    info = inspect_model(tiny_sd)
    assert (info.format, info.architecture, info.capabilities) == ("diffusers", "StableDiffusionPipeline",
                                                                   ["image-generation"])
    assert info.components == {"scheduler": "diffusers.DDIMScheduler", "text_encoder": "transformers.CLIPTextModel",
                                "tokenizer": "transformers.CLIPTokenizer", "unet": "diffusers.UNet2DConditionModel",
                                "vae": "diffusers.AutoencoderKL"}  # not the absent safety checker
    assert info.quantization == "F32" and 10_000 < info.parameters < 100_000


def test_dtype_variants_are_alternatives_not_extra_weights(tiny_sd: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(tiny_sd, tmp_path / "pipe")
    before = inspect_model(copy).parameters
    unet = copy / "unet"
    shutil.copy(unet / "diffusion_pytorch_model.safetensors", unet / "diffusion_pytorch_model.fp16.safetensors")
    assert inspect_model(copy).parameters == before  # the plain file counts, its variant does not
    (unet / "diffusion_pytorch_model.safetensors").unlink()
    assert inspect_model(copy).parameters == before  # only the variant: it counts


def test_broken_pipelines_are_refused(tiny_sd: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(tiny_sd, tmp_path / "pipe")
    shutil.rmtree(copy / "vae")
    with pytest.raises(ModelFormatError, match="no vae/ folder"):
        inspect_model(copy)
    (copy / "model_index.json").write_text(json.dumps({"unet": ["diffusers", "UNet2DConditionModel"]}))
    with pytest.raises(ModelFormatError, match="_class_name"):
        inspect_model(copy)


def test_pull_keeps_the_layout(tiny_sd: Path, tmp_path: Path) -> None:
    assert resolve_source(str(tiny_sd)).kind == "local"
    store = ModelStore(tmp_path)
    model = store.pull(str(tiny_sd), "sd")
    view = store.model_path(model)
    assert (view / "model_index.json").exists() and (view / "unet" / "diffusion_pytorch_model.safetensors").exists()
    assert model.info.components["vae"] == "diffusers.AutoencoderKL"


def test_a_hub_pipeline_pull_takes_the_plain_weights_only() -> None:
    files = ["model_index.json", "v1-5-pruned.safetensors", "v1-5-pruned.ckpt", "unet/config.json",
             "unet/diffusion_pytorch_model.safetensors", "unet/diffusion_pytorch_model.fp16.safetensors",
             "unet/diffusion_pytorch_model.non_ema.safetensors", "text_encoder/model.safetensors",
             "text_encoder/model.fp16.safetensors", "tokenizer/merges.txt", "tokenizer/vocab.json",
             "scheduler/scheduler_config.json", "README.md"]
    patterns = hf_patterns(files, None, "org/sd")
    assert patterns == DIFFUSERS_PATTERNS
    taken = sorted(f for f in files if any(fnmatch.fnmatch(f, p) for p in patterns))
    assert taken == ["model_index.json", "scheduler/scheduler_config.json", "text_encoder/model.safetensors",
                     "tokenizer/merges.txt", "tokenizer/vocab.json", "unet/config.json",
                     "unet/diffusion_pytorch_model.safetensors"]
    assert hf_patterns(["config.json", "model.safetensors"], None, "org/llm") == HF_PATTERNS
