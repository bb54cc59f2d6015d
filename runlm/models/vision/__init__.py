"""Vision-language models (images a model is given, to read): a vision tower and projector feeding the text decoder
runlm already runs. Image *generation* is runlm.image_generation's.

One module per family (``gemma3``, ``idefics3`` for SmolVLM, ``qwen2_5_vl``, ``llava``), each defining:

* ``MODEL_TYPES``: the Hugging Face ``model_type`` values it serves; ``PROJECTOR_TYPES``: llama.cpp's
  ``clip.projector_type`` values of the mmproj GGUF files it reads;
* ``text_config(hf_config) -> dict``: the text decoder's HF config (with its ``architectures``), which
  ``runlm.models.config.ModelConfig.from_hf`` reads as for any text model;
* ``text_weight(name) -> str | None``: a checkpoint name as the text decoder knows it
  (``model.layers.0...``, ``model.embed_tokens.weight``, ``lm_head.weight``), or None for the vision part's;
* ``build(hf_config, preprocessor, weights, tokenizer) -> VisionModel``: the tower + projector (an nn.Module,
  float32 on the CPU) and its processor, from the model's HF config, its image processor's config
  (``preprocessor_config.json``) and the checkpoint's vision and projector tensors (names as the checkpoint
  has them; the text model's are not among them). ``build_hf`` reads these from a safetensors directory,
  runlm.models.vision.mmproj translates llama.cpp's mmproj GGUF into them.

The text model needs nothing of the image beyond rows of embeddings at the image's positions
(runlm.models.attention.ForwardContext.mm_embeds), M-RoPE positions on Qwen2.5-VL, and bidirectional
attention among an image's tokens on Gemma 3 (ForwardContext.bidirectional).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

    from runlm.formats.gguf import GGUFFile
    from runlm.formats.tokenizer import Tokenizer
    from runlm.models.vision.inputs import ImageFeature, MultiModalPrompt

# family module -> (Hugging Face model_type values, llama.cpp clip.projector_type values): looked up without importing
# the family (its tower is torch's), so the store can tell a vision model from its config alone
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gemma3": (("gemma3",), ("gemma3",)),
    "idefics3": (("idefics3", "smolvlm"), ("idefics3",)),
    "qwen2_5_vl": (("qwen2_5_vl",), ("qwen2.5vl_merger",)),
    "llava": (("llava",), ("mlp",)),
    "pixtral": (("mistral3",), ("pixtral",)),
}


class ImageProcessor(Protocol):
    def process(self, token_ids: list[int], images: list[Image]) -> MultiModalPrompt:
        """Expand each image placeholder the chat template left in ``token_ids`` (one per image, in order) and
        turn each image into the tower's inputs; raises ImageError (a client's mistake) for what cannot be."""
        ...


class VisionModel(Protocol):
    """A family's tower + projector (a torch nn.Module) and the processor that feeds it."""
    processor: ImageProcessor
    uses_mrope: bool  # the text model takes [3, T] M-RoPE positions (Qwen2.5-VL)

    def encode(self, features: list[ImageFeature]) -> list[torch.Tensor]:
        """The text model's input embeddings for each image: [feature.num_embeds, text hidden], float32;
        one batched pass over every image given where the family allows."""
        ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...


def family_module(name: str) -> ModuleType:
    return importlib.import_module(f"runlm.models.vision.{name}")


def _name(value: object, index: int) -> str | None:
    return next((f for f, types in FAMILIES.items() if value in types[index]), None)


def _lookup(value: object, index: int) -> ModuleType | None:
    name = _name(value, index)
    return None if name is None else family_module(name)


def hf_family_name(hf_config: dict) -> str | None:
    """The family of a Hugging Face config (nothing imported), or None for a text-only model."""
    return _name(hf_config.get("model_type"), 0)


def mmproj_family_name(projector_type: str) -> str | None:
    """The family that reads mmproj files of this llama.cpp ``clip.projector_type`` (nothing imported)."""
    return _name(projector_type, 1)


# what a family's text model needs beyond embedding rows at the image's positions (runlm.models.attention), which
# the native runner does not do: read by the runner choice before any tower is built
TEXT_MODEL_NEEDS: dict[str, str] = {"qwen2_5_vl": "M-RoPE positions",
                                    "gemma3": "bidirectional attention among an image's tokens"}


def is_vision_config(hf_config: dict) -> bool:
    """Whether a Hugging Face config is a vision-language model runlm runs (nothing imported)."""
    return hf_family_name(hf_config) is not None


def hf_family(hf_config: dict) -> ModuleType | None:
    """The family module of a Hugging Face config, or None for a text-only model."""
    return _lookup(hf_config.get("model_type"), 0)


def mmproj_family(projector_type: str) -> ModuleType | None:
    return _lookup(projector_type, 1)


def processor_config(path: Path) -> dict:
    """The image processor's settings: preprocessor_config.json, or the image_processor of processor_config.json."""
    import json

    from runlm.formats import ModelFormatError

    for name in ("preprocessor_config.json", "processor_config.json"):
        f = path / name
        if f.is_file():
            if f.stat().st_size > 1 << 20:
                raise ModelFormatError(f"{f}: larger than 1 MiB")
            cfg = json.loads(f.read_text())
            return cfg.get("image_processor", cfg) if isinstance(cfg, dict) else {}
    raise ModelFormatError(f"{path}: a vision-language model needs preprocessor_config.json")


def build_hf(path: Path, hf_config: dict, weights: Any, tokenizer: Tokenizer) -> VisionModel | None:
    """The vision part of a safetensors directory (None for a text-only model). ``weights``: the checkpoint's
    (name, tensor) pairs that the family's text_weight did not claim."""
    family = hf_family(hf_config)
    return None if family is None else family.build(hf_config, processor_config(path), weights, tokenizer)


def build_mmproj(mmproj: GGUFFile, tokenizer: Tokenizer) -> VisionModel:
    from runlm.formats import ModelFormatError

    translate = family_module("mmproj")  # (llama.cpp's names and metadata -> Hugging Face's)
    kind = str(mmproj.metadata.get("clip.projector_type", ""))
    family = mmproj_family(kind)
    if family is None:
        raise ModelFormatError(f"{mmproj.path}: runlm does not read mmproj files of projector type {kind!r}")
    hf_config, preprocessor, weights = translate.as_hf(mmproj, family)
    return family.build(hf_config, preprocessor, weights, tokenizer)
