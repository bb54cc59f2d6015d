"""What a model is, read once from its path: ``ModelSpec``, handed to every loader and to the runner choice.

One pass over the path reads a GGUF file's header (its mapping is then the weights' memory: every loader computes
on views of it) or a directory's ``config.json``; from them the task, the decoder's config, the vision-language
family and llama.cpp's projector beside a GGUF file. The tokenizer and a directory's safetensors headers are read
on first use and kept, so a loader that needs them reads them once and one that does not never does. No torch
here (a sentence-transformers directory imports runlm.models.pooling to tell an embedder from a generator).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runlm.formats import ModelFormatError
from runlm.formats.architectures import ENCODER_GGUF_ARCHS, ENCODER_HF_ARCHS
from runlm.formats.gguf import GGUFFile
from runlm.formats.safetensors import SafetensorsDir, read_hf_config
from runlm.formats.tokenizer import Tokenizer
from runlm.models import vision as vlm
from runlm.models.config import ModelConfig

_DECODER_BODY_ARCHS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")


class NotAGeneratorError(ModelFormatError):
    """The model embeds or scores text; it cannot generate."""


@dataclass(slots=True)
class ModelSpec:
    path: Path
    format: str                         # "gguf" (a file) or "safetensors" (a directory)
    task: str                           # "generate", "embed" or "score"
    gguf: GGUFFile | None = None        # a GGUF file's header; its mapping holds the weights
    hf_config: dict | None = None       # a directory's config.json
    # the decoder's config (the text model's, for a vision-language model); None for an encoder, or where no family
    # reads it: config_error is then what reading it raised, for the loader that needs it to raise
    config: ModelConfig | None = None
    config_error: Exception | None = None
    vision: str | None = None           # the vision-language family (runlm.models.vision.FAMILIES), if it takes images
    projector: GGUFFile | None = None   # llama.cpp's mmproj file that goes with a GGUF model (its header)
    _tokenizer: Tokenizer | None = field(default=None, repr=False)
    _safetensors: SafetensorsDir | None = field(default=None, repr=False)

    @property
    def family(self) -> str | None:
        return self.config.family if self.config is not None else None

    def decoder_config(self) -> ModelConfig:
        """The decoder's config, or what kept it from being read (raised again: the loader's error)."""
        if self.task != "generate":
            raise NotAGeneratorError(f"{self.path}: this is an embedding model (or a reranker); it cannot generate "
                                     f"text (use it for embeddings or scores instead)")
        if self.config is None:
            raise self.config_error or ModelFormatError(f"{self.path}: no decoder config")
        return self.config

    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_gguf(self.gguf) if self.gguf is not None else \
                Tokenizer.from_dir(self.path, self.hf_config)
            if self.config is not None and not self.config.eos_token_ids and self._tokenizer.eos_token_id is not None:
                self.config.eos_token_ids = [self._tokenizer.eos_token_id]
        return self._tokenizer

    def safetensors(self) -> SafetensorsDir:
        """The directory's weight files, their headers read (and mapped) once."""
        if self._safetensors is None:
            self._safetensors = SafetensorsDir(self.path)
        return self._safetensors

    def bytes_by_type(self) -> dict[str, int]:
        """The weights' bytes per stored type (Q4_K, Q6_K, BF16...): what a runner computes on."""
        out: dict[str, int] = {}
        if self.gguf is not None:
            for info in self.gguf.tensors.values():
                out[info.qtype] = out.get(info.qtype, 0) + info.n_bytes
        else:
            for t in self.safetensors().tensors.values():
                out[t.qtype] = out.get(t.qtype, 0) + t.end - t.begin
        return out

    def weight_maps(self) -> list[np.ndarray]:
        """The mapped bytes of the weights' files: the GGUF file's, or each of a directory's *.safetensors."""
        return self.gguf.maps if self.gguf is not None else self.safetensors().maps()

    @property
    def weight_bytes(self) -> int:
        return sum(self.bytes_by_type().values())


def read_spec(path: str | Path, mmproj: str | Path | None = None, find_projector: bool = True) -> ModelSpec:
    """The model at ``path`` (a .gguf file or a safetensors directory), read once. ``mmproj``: a projector file to
    use; a GGUF model without one takes the one mmproj file beside it (runlm.models.vision.mmproj.find_projector)
    unless ``find_projector`` is False."""
    path = Path(path)
    if path.is_file():
        return _gguf_spec(path, mmproj, find_projector)
    if not path.is_dir():
        raise ModelFormatError(f"{path}: no such model file or directory")
    spec = _dir_spec(path)
    if mmproj is not None and spec.vision is None:  # a text checkpoint with llama.cpp's projector
        spec.projector = GGUFFile(Path(mmproj))
        spec.vision = vlm.mmproj_family_name(str(spec.projector.metadata.get("clip.projector_type", "")))
    return spec


def as_spec(model: ModelSpec | str | Path, mmproj: str | Path | None = None) -> ModelSpec:
    """A loader's argument: a spec already read, or a path to read now (with the projector named, none found)."""
    return model if isinstance(model, ModelSpec) else read_spec(model, mmproj, find_projector=False)


def _gguf_spec(path: Path, mmproj: str | Path | None, find: bool) -> ModelSpec:
    gguf = GGUFFile(path)
    spec = ModelSpec(path, "gguf", "embed" if gguf.architecture in ENCODER_GGUF_ARCHS else "generate", gguf=gguf)
    if spec.task == "generate":
        try:
            gguf.check_architecture()
            spec.config = ModelConfig.from_gguf(gguf)
        except Exception as exc:  # a damaged or foreign file: the loader that needs the config raises it
            spec.config_error = exc
        if mmproj is not None:
            spec.projector = GGUFFile(Path(mmproj))
        elif find:
            from runlm.models.vision.mmproj import find_projector

            spec.projector = find_projector(path)
        if spec.projector is not None:
            spec.vision = vlm.mmproj_family_name(str(spec.projector.metadata.get("clip.projector_type", "")))
    return spec


def _dir_spec(path: Path) -> ModelSpec:
    hf_config = read_hf_config(path)
    if not isinstance(hf_config, dict):
        raise ModelFormatError(f"{path / 'config.json'}: not a JSON object")
    vision = vlm.hf_family_name(hf_config)
    spec = ModelSpec(path, "safetensors", "generate" if vision is not None else _hf_task(hf_config, path),
                     hf_config=hf_config, vision=vision)
    if spec.task != "score":  # (a bare decoder body that embeds has a decoder's config too)
        try:
            text = vlm.family_module(vision).text_config(hf_config) if vision is not None else hf_config
            spec.config = ModelConfig.from_hf(text, source=str(path / "config.json"))
        except Exception as exc:
            spec.config_error = exc
    return spec


def _hf_task(cfg: dict, path: Path) -> str:
    archs = cfg.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in archs) or cfg.get("classifier_from_token"):
        return "score"
    is_encoder = any(a in ENCODER_HF_ARCHS for a in archs) or cfg.get("model_type") in ("bert", "roberta")
    # a bare decoder body (Qwen3Model) or one shipped with a sentence-transformers pooler embeds
    is_embedder = any(a in _DECODER_BODY_ARCHS for a in archs) or _sentence_transformers_pooling(path)
    return "embed" if is_encoder or is_embedder else "generate"


def _sentence_transformers_pooling(path: Path) -> bool:
    """Whether the directory ships a sentence-transformers pooler (runlm.models.pooling, torch's: imported only
    where modules.json is there, so a generator's directory is told apart without torch)."""
    if not (path / "modules.json").is_file():
        return False
    from runlm.models.pooling import has_sentence_transformers_pooling

    return has_sentence_transformers_pooling(path)


def model_task(path: Path) -> str:
    """'generate', 'embed' or 'score', from the file's own metadata (no weights read)."""
    return read_spec(path).task


__all__ = ["ModelSpec", "NotAGeneratorError", "as_spec", "model_task", "read_spec"]
