"""Which file names are llama.cpp's multimodal projectors (``mmproj*.gguf``), and which is a model's. Names only."""
from __future__ import annotations

import os

MAX_PROJECTOR_NAME = 255


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
