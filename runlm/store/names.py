"""Model names: ``name[:tag]``, validated so that no name can point outside the store."""
from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_TAG = "latest"
# one path segment of a name: starts with a letter or digit, so "." and ".." can never be one
_SEGMENT = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_TAG = re.compile(r"[a-z0-9_][a-z0-9._-]{0,127}")
_MAX_SEGMENTS = 4


class InvalidNameError(ValueError):
    """A model name that is not ``name[:tag]`` made of safe characters."""


@dataclass(slots=True, frozen=True)
class ModelName:
    name: str  # e.g. "smollm2" or "huggingfacetb/smollm2-135m"
    tag: str = DEFAULT_TAG

    def __str__(self) -> str:
        return f"{self.name}:{self.tag}"

    @property
    def parts(self) -> list[str]:
        """Path components under the store's manifests folder (every one validated)."""
        return [*self.name.split("/"), self.tag]

    @classmethod
    def parse(cls, text: str) -> ModelName:
        """'SmolLM2' -> smollm2:latest; 'org/repo:q4' -> org/repo:q4. Names are case-insensitive."""
        raw = text.strip()
        while raw.startswith("hf.co/"):  # all of them: a stored name must never start with it, or it would
            raw = raw[len("hf.co/"):]     # print as a name that reads back as another
        name, sep, tag = raw.rpartition(":") if ":" in raw.rsplit("/", 1)[-1] else (raw, "", "")
        name, tag = name.lower(), (tag.lower() if sep else DEFAULT_TAG)
        segments = name.split("/")
        if not name or len(segments) > _MAX_SEGMENTS or not all(_SEGMENT.fullmatch(s) for s in segments):
            raise InvalidNameError(
                f"invalid model name {text!r}: use name[:tag], where the name is one to {_MAX_SEGMENTS} "
                f"'/'-separated parts of letters, digits, '.', '_' or '-' (each starting with a letter or digit)")
        if not _TAG.fullmatch(tag):
            raise InvalidNameError(f"invalid tag {tag!r} in {text!r}: letters, digits, '.', '_' or '-' only")
        return cls(name, tag)


def default_name_for(text: str) -> str:
    """A valid model name derived from a file name or a repo id ('My Model.Q4.gguf' -> 'my-model.q4')."""
    base = text.lower()
    base = re.sub(r"\.gguf$", "", base)
    base = re.sub(r"[^a-z0-9._/-]+", "-", base).strip("-./")
    base = "/".join(s.strip("-.") for s in base.split("/") if s.strip("-."))
    return base or "model"
