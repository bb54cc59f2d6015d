"""What a model file or directory is, read from its headers: the one entry point for every layout."""
from __future__ import annotations

from pathlib import Path

from runlm.formats.projector_names import looks_like_projector
from runlm.store.metadata import ModelInfo, inspect_gguf, inspect_safetensors_dir
from runlm.store.pipeline_info import inspect_diffusers_dir


def inspect_model(path: Path) -> ModelInfo:
    """A .gguf file, a safetensors model directory or a diffusers pipeline directory -> its ModelInfo."""
    if path.is_dir() and (path / "model_index.json").exists():
        return inspect_diffusers_dir(path)
    if path.is_dir():
        ggufs = sorted(p for p in path.glob("*.gguf") if not looks_like_projector(p.name))
        if ggufs and not (path / "config.json").exists():
            return inspect_gguf(ggufs[0])
        return inspect_safetensors_dir(path)
    return inspect_gguf(path)
