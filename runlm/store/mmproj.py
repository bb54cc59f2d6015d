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

DMR_MMPROJ = "application/vnd.docker.ai.mmproj"
OLLAMA_PROJECTOR = "application/vnd.ollama.image.projector"
PROJECTOR_TYPES = (DMR_MMPROJ, OLLAMA_PROJECTOR)
PROJECTOR_ARCHITECTURE = "clip"
MAX_PROJECTOR_NAME = 255


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


def looks_like_projector(name: str) -> bool:
    lower = name.lower()
    return lower.endswith(".gguf") and "mmproj" in lower and not name.startswith(".") \
        and len(name) <= MAX_PROJECTOR_NAME


def choose_projector(model_name: str, names: list[str]) -> str | None:
    """Which of a folder's file names is the projector of the GGUF ``model_name``: the only ``*mmproj*.gguf``,
    or among several the one named after the model (``mmproj-<model stem>...``); None when there is none or
    the names do not say which (a folder of several models and projectors)."""
    candidates = sorted(n for n in names if n != model_name and looks_like_projector(n))
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    stem = model_name.lower().removesuffix(".gguf")
    # llama.cpp's layout: Model-Q4_K_M.gguf beside mmproj-Model-f16.gguf; the longest shared prefix of the
    # names with "mmproj" taken out wins, when one name wins alone
    def shared(name: str) -> int:
        rest = name.lower().removesuffix(".gguf").replace("mmproj-", "").replace("-mmproj", "").replace("mmproj", "")
        return len(os.path.commonprefix([stem, rest]))

    scores = sorted(((shared(n), n) for n in candidates), reverse=True)
    if scores[0][0] > 0 and scores[0][0] > scores[1][0]:
        return scores[0][1]
    return None


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
