"""The images' embeddings, computed once: keyed by the image's content hash, so a later turn (or another
request) with the same picture runs no vision-tower work. Least recently used entries go first when the
cache is over its size; ``reset()`` (reset_mm_cache) empties it.

A step's images are looked up together and the missing ones run through the tower in one batched call.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from runlm.models.vision.inputs import ImageFeature

DEFAULT_CACHE_BYTES = 256 << 20


def _nbytes(value: Any) -> int:
    nbytes = getattr(value, "nbytes", None)
    return int(nbytes) if nbytes is not None else int(value.numel() * value.element_size())


class EncoderCache:
    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, Any] = OrderedDict()
        self.bytes = 0
        self.images_encoded = 0  # images run through the tower since start (a cache hit adds nothing)
        self.tower_calls = 0     # batched calls of the tower
        self.hits = 0

    def embeddings(self, features: Sequence[ImageFeature],
                   encode: Callable[[list[ImageFeature]], list[Any]]) -> list[Any]:
        """Each feature's embeddings [num_embeds, hidden]: cached ones as they are, the rest from one call of
        ``encode`` over them (each image once, however many features name it)."""
        missing: dict[str, ImageFeature] = {}
        for f in features:
            if f.hash in self.entries:
                self.entries.move_to_end(f.hash)
                self.hits += 1
            else:
                missing.setdefault(f.hash, f)
        fresh: dict[str, Any] = {}
        if missing:
            todo = list(missing.values())
            out = encode(todo)
            self.tower_calls += 1
            self.images_encoded += len(todo)
            for f, e in zip(todo, out, strict=True):
                if e.shape[0] != f.num_embeds:
                    raise RuntimeError(f"the vision tower gave {e.shape[0]} rows for an image with {f.num_embeds} "
                                       f"positions")
                fresh[f.hash] = e
                self._put(f.hash, e)
        return [fresh[f.hash] if f.hash in fresh else self.entries[f.hash] for f in features]

    def _put(self, key: str, value: Any) -> None:
        size = _nbytes(value)
        if size > self.max_bytes:
            return  # larger than the whole cache: used for this step only
        self.entries[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= _nbytes(old)

    def reset(self) -> None:
        self.entries.clear()
        self.bytes = 0
