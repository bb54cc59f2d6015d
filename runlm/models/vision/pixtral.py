"""Mistral 3 (Mistral Small 3.1 / 3.2: transformers' Mistral3ForConditionalGeneration, model_type ``mistral3``):
the Pixtral vision tower, a patch merger and a two-layer projector feeding a Mistral decoder; llama.cpp calls
the projector ``pixtral``.

Pixtral takes each image at its own size (the longest edge at most ``size["longest_edge"]``, both sides rounded
up to a multiple of patch_size x spatial_merge_size): a patch convolution, an RMS norm, then pre-norm layers
with 2-D RoPE (rows on half the frequencies, columns on the other half) and SwiGLU MLPs, each image attending
only within itself. The projector RMS-norms the patches, merges each 2 x 2 block of them into one (a linear
layer over their concatenation), then linear -> GELU -> linear. The prompt holds one ``[IMG]`` per image; it
becomes a grid of rows, each row ``[IMG]`` x width then ``[IMG_BREAK]``, the last break being ``[IMG_END]``
(PixtralProcessor's layout); the image's rows replace the ``[IMG]`` tokens, the breaks stay text.

Importing this module imports no torch (every family is asked whether it serves a config): the tower is
runlm.models.vision.pixtral_tower, imported by ``build``.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from runlm.formats import ModelFormatError
from runlm.models.vision.images import ImageError, rescale_normalize
from runlm.models.vision.inputs import ImageFeature, MultiModalPrompt, content_hash

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

    from runlm.formats.tokenizer import Tokenizer
    from runlm.models.vision.pixtral_tower import PixtralVision

MODEL_TYPES = ("mistral3",)
PROJECTOR_TYPES = ("pixtral",)

IMAGE_TOKEN, BREAK_TOKEN, END_TOKEN = "[IMG]", "[IMG_BREAK]", "[IMG_END]"

# Mistral3Config's text_config and vision_config when a file leaves fields out
_TEXT_DEFAULTS: dict[str, Any] = dict(
    architectures=["MistralForCausalLM"], model_type="mistral", head_dim=128, hidden_size=5120,
    intermediate_size=32768, max_position_embeddings=131072, num_attention_heads=32, num_hidden_layers=40,
    num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1000000000.0, sliding_window=None, vocab_size=131072)
_VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, num_channels=3,
    patch_size=14, hidden_act="gelu", rope_theta=10000.0)

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3

# ---- configs --------------------------------------------------------------------------------------------------
def text_config(hf_config: dict) -> dict:
    text = dict(hf_config.get("text_config") or {})
    cfg = {**_TEXT_DEFAULTS, **text}
    if text.get("rope_parameters") or text.get("rope_scaling"):
        if "rope_theta" not in text:
            cfg.pop("rope_theta")  # the theta inside rope_parameters is the one
    if not text.get("architectures"):
        cfg["architectures"] = ["MistralForCausalLM"]
    # the text config's own setting (transformers ties only when the checkpoint has no lm_head)
    cfg["tie_word_embeddings"] = bool(text.get("tie_word_embeddings", False))
    return cfg


def vision_config(hf_config: dict) -> dict:
    vision = dict(hf_config.get("vision_config") or {})
    if vision.get("model_type", "pixtral") != "pixtral":
        raise ModelFormatError(f"Mistral 3 with a {vision['model_type']!r} vision tower is not supported")
    cfg = {**_VISION_DEFAULTS, **vision}
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope, dict) and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    return cfg


def text_weight(name: str) -> str | None:
    """transformers 5's names (``model.language_model.*``, ``lm_head.weight``) and the hub's (``language_model.
    model.*``, ``language_model.lm_head.weight``) as the text decoder has them; None for the vision part's."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model.model."):
        return "model." + name[len("language_model.model."):]
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    return None


# ---- the image processor -----------------------------------------------------------------------------------
class PixtralImageProcessor:
    """PixtralImageProcessor with transformers' PIL backend's numerics, and PixtralProcessor's ``[IMG]`` grid."""

    def __init__(self, preprocessor: dict, align: int, ids: tuple[int, int, int]) -> None:
        p = preprocessor
        size = p.get("size") or {"longest_edge": 1024}
        if size.get("longest_edge"):
            self.max_hw = (int(size["longest_edge"]), int(size["longest_edge"]))
        elif size.get("height") and size.get("width"):
            self.max_hw = (int(size["height"]), int(size["width"]))
        else:
            raise ModelFormatError(f"the Pixtral image processor's size {size} names no longest_edge")
        self.align = align  # patch_size x spatial_merge_size: each side a multiple of it
        self.do_resize = bool(p.get("do_resize", True))
        if not self.do_resize:
            raise ModelFormatError("a Pixtral image processor without do_resize is not supported")
        self.resample = int(p.get("resample", _BICUBIC))
        self.do_rescale = bool(p.get("do_rescale", True))
        self.rescale_factor = float(p.get("rescale_factor", 1 / 255))
        self.do_normalize = bool(p.get("do_normalize", True))
        self.mean = tuple(float(x) for x in p.get("image_mean", _CLIP_MEAN))
        self.std = tuple(float(x) for x in p.get("image_std", _CLIP_STD))
        self.image_token_id, self.break_token_id, self.end_token_id = ids
        self.settings = (self.max_hw, align, self.resample, self.do_rescale, self.rescale_factor, self.do_normalize,
                         self.mean, self.std)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize: within the maximum, each side rounded up to the alignment."""
        ratio = max(height / self.max_hw[0], width / self.max_hw[1])
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        if height < 1 or width < 1:
            return 0, 0
        a = self.align
        return ((height - 1) // a + 1) * a, ((width - 1) // a + 1) * a

    def pixels(self, image: Image) -> np.ndarray:
        h, w = self.output_size(image.height, image.width)
        if h < 1 or w < 1:
            raise ImageError(f"the image is {image.width}x{image.height}: its aspect ratio is too extreme (its short "
                             f"side would shrink to nothing within {self.max_hw[1]}x{self.max_hw[0]} pixels)")
        image = image.resize((w, h), resample=self.resample)
        out = rescale_normalize(np.asarray(image, dtype=np.uint8), self.rescale_factor if self.do_rescale else None,
                                *((self.mean, self.std) if self.do_normalize else ()))
        return np.ascontiguousarray(out.transpose(2, 0, 1), dtype=np.float32)

    def process(self, token_ids: list[int], images: list[Image]) -> MultiModalPrompt:
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise ImageError(f"the prompt has {len(slots)} {IMAGE_TOKEN} placeholders for {len(images)} images "
                             f"(one per image)")
        ids: list[int] = []
        features = []
        last = 0
        for slot, image in zip(slots, images):
            ids.extend(token_ids[last:slot])
            last = slot + 1
            pixels = self.pixels(image)
            rows, cols = pixels.shape[1] // self.align, pixels.shape[2] // self.align
            start = len(ids)
            grid = ([self.image_token_id] * cols + [self.break_token_id]) * rows
            grid[-1] = self.end_token_id
            ids.extend(grid)
            positions = (start + np.arange(rows)[:, None] * (cols + 1) + np.arange(cols)[None, :]).reshape(-1)
            h = content_hash(image.tobytes(), image.size, image.mode, *self.settings)
            features.append(ImageFeature(h, positions.astype(np.int64), {"pixel_values": pixels}))
        ids.extend(token_ids[last:])
        return MultiModalPrompt(ids, features)


def token_ids(hf_config: dict, tokenizer: Tokenizer | None) -> tuple[int, int, int]:
    def look(name: str) -> int | None:
        return tokenizer.hf.token_to_id(name) if tokenizer is not None else None

    image = hf_config.get("image_token_index", hf_config.get("image_token_id"))
    image = look(IMAGE_TOKEN) if image is None else image
    brk, end = look(BREAK_TOKEN), look(END_TOKEN)
    if image is None or brk is None or end is None:
        raise ModelFormatError(f"the tokenizer lacks Pixtral's image tokens ({IMAGE_TOKEN}, {BREAK_TOKEN}, "
                               f"{END_TOKEN})")
    return int(image), int(brk), int(end)


def build(hf_config: dict, preprocessor: dict, weights: Iterable[tuple[str, torch.Tensor]],
          tokenizer: Tokenizer, llava: bool = False) -> PixtralVision:
    """``llava``: for runlm.models.vision.llava, a ``llava`` config with a Pixtral tower (Pixtral-12B's shape: no
    norm nor patch merger before the projector's MLP, whose biases default to on)."""
    from runlm.models.vision.pixtral_tower import PixtralVision

    vc = vision_config(hf_config)
    n = int(vc["num_hidden_layers"])
    layer = hf_config.get("vision_feature_layer", -1)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ModelFormatError(f"vision_feature_layer {layer!r}: runlm reads one layer (an int), not several")
    if not -(n + 1) <= layer <= n:
        raise ModelFormatError(f"vision_feature_layer {layer} is outside the tower's {n} layers")
    if llava and hf_config.get("vision_feature_select_strategy", "default") != "full":
        raise ModelFormatError("LLaVA with a Pixtral tower reads every patch: vision_feature_select_strategy "
                               "must be 'full'")
    merge = 1 if llava else int(hf_config.get("spatial_merge_size", 2))
    weights = list(weights)
    text = {**_TEXT_DEFAULTS, **(hf_config.get("text_config") or {})}
    # the decoder's width: the projector's own shape (an mmproj file has no text_config), else the config's
    projector = "multi_modal_projector.linear_2.weight"
    text_hidden = (next((int(t.shape[0]) for name, t in weights if name.endswith(projector)), None)
                   or int(text["hidden_size"]))
    patch = int(vc["patch_size"])
    processor = PixtralImageProcessor(preprocessor, patch * merge, token_ids(hf_config, tokenizer))
    model = PixtralVision(vc, layer % (n + 1), None if llava else merge, text_hidden, float(text["rms_norm_eps"]),
                          hf_config.get("projector_hidden_act", "gelu"),
                          bool(hf_config.get("multimodal_projector_bias", llava)), processor)
    model.load_hf(weights)
    return model.eval()
