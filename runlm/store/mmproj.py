"""Multimodal projectors: llama.cpp's ``mmproj`` GGUF (a vision tower and projector) kept beside a text GGUF.

A model that has one lists it among its files with a projector media type: Docker Model Runner's
``application/vnd.docker.ai.mmproj`` layer (``docker model package --mmproj``), Ollama's
``application/vnd.ollama.image.projector`` layer, or a local import that found one beside its GGUF
(``mmproj-*.gguf`` in the same folder, as llama.cpp users lay them out) or was given one (``--mmproj``).
The runner starts the engine with ``--mmproj`` on that file.

A projector is told apart by its header: ``general.architecture`` is ``clip`` (what convert_hf_to_gguf.py
--mmproj writes). Only files whose names say ``mmproj`` are looked at beside a model, and their headers are
read with the bounded GGUF reader.
"""
from __future__ import annotations

import os
from pathlib import Path

from runlm.formats import ModelFormatError
from runlm.formats.projector_names import choose_projector

DMR_MMPROJ = "application/vnd.docker.ai.mmproj"
OLLAMA_PROJECTOR = "application/vnd.ollama.image.projector"
PROJECTOR_TYPES = (DMR_MMPROJ, OLLAMA_PROJECTOR)
PROJECTOR_ARCHITECTURE = "clip"


def is_projector_entry(entry: dict) -> bool:
    """Whether one of a stored model's files (``{"path", "digest", "size", "media_type"?}``) is its projector."""
    return str(entry.get("media_type", "")).split(";")[0] in PROJECTOR_TYPES


def projector_entry(files: list[dict]) -> dict | None:
    return next((f for f in files if is_projector_entry(f)), None)


def gguf_architecture(path: str | os.PathLike) -> str | None:
    """``general.architecture`` of a GGUF file (None when it is no readable GGUF); the bounded header reader."""
    from runlm.formats.gguf_header import read_header

    try:
        _, metadata, _ = read_header(path)
    except (OSError, ValueError, IndexError, KeyError, OverflowError):
        return None
    arch = metadata.get("general.architecture")
    return arch if isinstance(arch, str) else None


def is_projector_file(path: str | os.PathLike) -> bool:
    return gguf_architecture(path) == PROJECTOR_ARCHITECTURE


def check_projector(path: Path) -> None:
    """Raise ModelFormatError unless ``path`` is an mmproj GGUF (a file whose architecture is ``clip``)."""
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file (--mmproj names llama.cpp's projector GGUF)")
    arch = gguf_architecture(path)
    if arch != PROJECTOR_ARCHITECTURE:
        what = "not a readable GGUF file" if arch is None else f"a GGUF of architecture {arch[:40]!r}"
        raise ModelFormatError(f"{path.name}: {what}, not a multimodal projector (an mmproj GGUF's architecture "
                               f"is 'clip': convert_hf_to_gguf.py --mmproj writes one)")


def projector_beside(model: Path) -> Path | None:
    """The projector in the folder of the GGUF file ``model``, if one is there and its header says so."""
    try:
        names = [e.name for e in os.scandir(model.parent) if e.is_file()]
    except OSError:
        return None
    chosen = choose_projector(model.name, names)
    if chosen is None:
        return None
    path = model.parent / chosen
    return path if is_projector_file(path) else None
