"""What a diffusers pipeline directory is, from ``model_index.json`` and its weights' headers.

A pipeline is one folder per component (unet, vae, text_encoder, tokenizer, scheduler, ...);
``model_index.json`` names the pipeline class and each component's library and class. Weights
of a dtype variant (``*.fp16.safetensors``) are alternatives to the plain files, so they count
only where a component has no plain file.
"""
from __future__ import annotations

import json
from pathlib import Path

from runlm.formats import ModelFormatError
from runlm.store.metadata import ModelInfo, count_parameters

# the weight file names diffusers and transformers save (sharded: name-00001-of-00002.safetensors)
WEIGHT_STEMS = ("diffusion_pytorch_model", "model")


def pipeline_components(index: dict) -> dict[str, str]:
    """model_index.json -> {component: 'library.Class'} for the components present (not the [null, null] ones)."""
    out = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or None in value:
            continue
        out[name] = f"{value[0]}.{value[1]}"
    return out


def component_weights(folder: Path) -> list[Path]:
    """The safetensors files diffusers would load for one component: the plain ones, else one variant's."""
    files = sorted(folder.glob("*.safetensors"))
    plain = [f for f in files if f.name.split(".")[0].split("-0")[0] in WEIGHT_STEMS and f.name.count(".") == 1]
    if plain or not files:
        return plain
    variant = files[0].name.split(".")[-2]  # diffusion_pytorch_model.fp16.safetensors -> fp16
    return [f for f in files if f.name.split(".")[-2] == variant]


def inspect_diffusers_dir(directory: Path) -> ModelInfo:
    try:
        index = json.loads((directory / "model_index.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{directory.name}: no readable model_index.json ({exc})") from exc
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise ModelFormatError(f"{directory.name}: model_index.json names no pipeline class (_class_name)")
    components = pipeline_components(index)
    for name in components:
        if not (directory / name).is_dir():
            raise ModelFormatError(f"{directory.name}: model_index.json names component {name!r} but there is no "
                                   f"{name}/ folder")
    files = [f for name in components for f in component_weights(directory / name)]
    if not files:
        raise ModelFormatError(f"{directory.name}: no *.safetensors weights in the pipeline's component folders")
    params, dtypes = count_parameters(files)
    return ModelInfo(format="diffusers", architecture=index["_class_name"], parameters=params,
                     quantization=max(dtypes, key=lambda d: dtypes[d]) if dtypes else "unknown",
                     context_length=0, capabilities=["image-generation"], components=components)
