"""What an image becomes before the engine sees it: its place in the prompt and the tower's inputs.

A family's processor (runlm.models.vision.<family>) turns the rendered prompt's token ids and the
request's images into a ``MultiModalPrompt``: the ids with each image's placeholder expanded to the
number of soft tokens its embeddings fill, and one ``ImageFeature`` per image. The engine keys its
encoder cache and the prefix cache by ``ImageFeature.hash``, runs the tower on ``ImageFeature.data``
and writes the tower's rows over the token embeddings at ``ImageFeature.positions``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True, eq=False)
class ImageFeature:
    hash: str                # the image's content and the processor's settings: keys the encoder and prefix caches
    positions: np.ndarray    # int64, ascending: the prompt indices whose embeddings this image supplies
    data: dict[str, Any]     # the processor's output for this image alone (numpy arrays: pixel values, grids, ...)
    bidirectional: bool = False  # the text model attends bidirectionally among this image's tokens (Gemma 3)

    @property
    def start(self) -> int:
        return int(self.positions[0])

    @property
    def end(self) -> int:
        """One past the last position: an image's tokens lie in start..end (with text between on some families)."""
        return int(self.positions[-1]) + 1

    @property
    def num_embeds(self) -> int:
        return int(self.positions.shape[0])


@dataclass(slots=True)
class MultiModalPrompt:
    token_ids: list[int]
    features: list[ImageFeature] = field(default_factory=list)
    # M-RoPE (Qwen2.5-VL): int64 [3, len(token_ids)] positions of the prompt; the token at index i >= the
    # prompt's length sits at position i + mrope_delta on all three axes
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0


def content_hash(data: bytes, *settings: object) -> str:
    """The hash an image is known by: its bytes (the decoded pixels, so two encodings of one picture agree) and
    whatever of the processor's settings changes what the tower sees."""
    h = hashlib.blake2b(data, digest_size=16)
    for s in settings:
        h.update(repr(s).encode())
    return h.hexdigest()
