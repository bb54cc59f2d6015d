"""LLaVA (transformers' LlavaForConditionalGeneration, model_type ``llava``): a CLIP or SigLIP tower read at
``vision_feature_layer``, a two-layer MLP projector, and a Llama-family decoder; llama.cpp calls the projector
``mlp`` (LLaVA-1.5's mmproj files).

The tower's hidden states at ``vision_feature_layer`` (-2 for LLaVA-1.5: the second-to-last layer's output, no
final norm) go through the projector as they are ("full") or without CLIP's class token ("default"). Each image
is one fixed-size square (CLIPImageProcessor: shortest edge resized, center crop; SiglipImageProcessor: resized
to the square; LlavaImageProcessor may pad to a square first), so it fills the same number of soft tokens: every
``<image>`` of the prompt is repeated that many times, as LlavaProcessor does, and the image's rows replace them.

A ``llava`` config with a Pixtral tower (Pixtral-12B: each image at its own size, ``[IMG]`` rows) is built by
runlm.models.vision.pixtral. Importing this module imports no torch (every family is asked whether it serves a
config, the model store's among the askers): the tower is runlm.models.vision.llava_tower, imported by ``build``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from runlm.formats import ModelFormatError
from runlm.models.vision import pixtral
from runlm.models.vision.images import MAX_IMAGE_PIXELS, ImageError, rescale_normalize
from runlm.models.vision.inputs import ImageFeature, MultiModalPrompt, content_hash

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

    from runlm.formats.tokenizer import Tokenizer
    from runlm.models.vision.llava_tower import LlavaVision
    from runlm.models.vision.pixtral_tower import PixtralVision

MODEL_TYPES = ("llava",)
PROJECTOR_TYPES = ("mlp",)

IMAGE_TOKEN = "<image>"

# transformers' defaults for what a config.json leaves out (llava-hf's configs name only what differs); not the
# special tokens: without them the tokenizer's are used
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6),
    "mistral": dict(architectures=["MistralForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=4096),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6),
}
_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=224, patch_size=32, num_channels=3, layer_norm_eps=1e-5,
                              hidden_act="quick_gelu"),
    "siglip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                image_size=224, patch_size=16, num_channels=3, layer_norm_eps=1e-6,
                                hidden_act="gelu_pytorch_tanh"),
}
# LlavaConfig's vision_config when the file has none: LLaVA-1.5's CLIP ViT-L/14 at 336 pixels
_LLAVA_VISION = dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                     num_attention_heads=16, image_size=336, patch_size=14)

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


# ---- configs --------------------------------------------------------------------------------------------------
def text_config(hf_config: dict) -> dict:
    text = dict(hf_config.get("text_config") or {})
    model_type = text.get("model_type") or "llama"
    cfg = {**_TEXT_DEFAULTS.get(model_type, {}), **text, "model_type": model_type}
    # LlavaConfig ties the embeddings when either config says so
    cfg["tie_word_embeddings"] = bool(hf_config.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    return cfg


def vision_config(hf_config: dict) -> dict:
    given = hf_config.get("vision_config")
    vision = dict(_LLAVA_VISION if given is None else given)
    model_type = vision.get("model_type") or "clip_vision_model"
    if model_type not in _VISION_DEFAULTS:
        raise ModelFormatError(f"LLaVA with a {model_type!r} vision tower is not supported (runlm reads CLIP, "
                               f"SigLIP and Pixtral towers)")
    return {**_VISION_DEFAULTS[model_type], **vision, "model_type": model_type}


# the text decoder's names: the same two checkpoint layouts as Mistral 3's
text_weight = pixtral.text_weight


# ---- the image processor -----------------------------------------------------------------------------------
class LlavaImageProcessor:
    """CLIPImageProcessor / SiglipImageProcessor / LlavaImageProcessor with transformers' PIL backend's numerics
    (PIL resize of the uint8 image, center crop padded with zeros when the image is smaller, rescale in float64
    then float32, normalize in float32), and LlavaProcessor's placeholder expansion in token-id space."""

    def __init__(self, preprocessor: dict, image_token_id: int, num_image_tokens: int, image_size: int,
                 siglip: bool) -> None:
        kind = str(preprocessor.get("image_processor_type") or "").removesuffix("Fast").removesuffix("Pil")
        self.siglip = kind == "SiglipImageProcessor" or (not kind and siglip)
        square = {"height": 224, "width": 224}
        p = preprocessor
        self.do_resize = bool(p.get("do_resize", True))
        self.size = dict(p.get("size") or (square if self.siglip else {"shortest_edge": 224}))
        self.resample = int(p.get("resample", _BICUBIC))
        self.do_center_crop = bool(p.get("do_center_crop", not self.siglip))
        self.crop_size = dict(p.get("crop_size") or square)
        self.do_rescale = bool(p.get("do_rescale", True))
        self.rescale_factor = float(p.get("rescale_factor", 1 / 255))
        self.do_normalize = bool(p.get("do_normalize", True))
        default_mean, default_std = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)) if self.siglip else (_CLIP_MEAN, _CLIP_STD)
        self.mean = _triple(p.get("image_mean", default_mean))
        self.std = _triple(p.get("image_std", default_std))
        self.do_pad = bool(p.get("do_pad", False)) and kind == "LlavaImageProcessor"
        self.image_token_id, self.num_image_tokens = image_token_id, num_image_tokens
        out = self.output_size()
        if out != (image_size, image_size):
            raise ModelFormatError(f"the image processor's output ({out}) is not the tower's {image_size}x"
                                   f"{image_size} square")
        self.settings = (kind, self.do_resize, sorted(self.size.items()), self.resample, self.do_center_crop,
                         sorted(self.crop_size.items()), self.do_rescale, self.rescale_factor, self.do_normalize,
                         self.mean, self.std, self.do_pad)

    def output_size(self) -> tuple[int, int] | str:
        """(height, width) of every processed image, whatever its size; a description when it varies."""
        if self.do_center_crop:
            return int(self.crop_size["height"]), int(self.crop_size["width"])
        if self.do_resize and self.size.get("height") and self.size.get("width"):
            return int(self.size["height"]), int(self.size["width"])
        return "the input's aspect ratio"

    def resize_to(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the resize step (transformers' get_resize_output_image_size, not to square)."""
        size = self.size
        if size.get("shortest_edge"):
            if size.get("longest_edge"):
                raise ModelFormatError("an image processor with both shortest_edge and longest_edge is not "
                                       "supported for LLaVA")
            s = int(size["shortest_edge"])
            short, long = (width, height) if width <= height else (height, width)
            new_long = int(s * long / short)
            return (s, new_long) if width <= height else (new_long, s)
        if size.get("height") and size.get("width"):
            return int(size["width"]), int(size["height"])
        raise ModelFormatError(f"the image processor's size {size} names no shortest_edge nor height and width")

    def pixels(self, image: Image) -> np.ndarray:
        """float32 [3, H, W]: what the tower takes."""
        if self.do_pad and image.width != image.height:
            from PIL import Image as PILImage

            side = max(image.width, image.height)
            if side * side > 2 * MAX_IMAGE_PIXELS:
                raise ImageError(f"the image is {image.width}x{image.height}: padded to a square it would be "
                                 f"{side}x{side} pixels, over the limit of {2 * MAX_IMAGE_PIXELS}")
            fill = tuple(int(m * 255) for m in self.mean)
            square = PILImage.new("RGB", (side, side), fill)  # type: ignore[arg-type]
            square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
            image = square
        if self.do_resize:
            w, h = self.resize_to(image.width, image.height)
            if w * h > MAX_IMAGE_PIXELS:  # a thin strip's shortest edge scaled up
                raise ImageError(f"the image is {image.width}x{image.height}: its aspect ratio is too extreme (resized "
                                 f"to {w}x{h} pixels, over the limit of {MAX_IMAGE_PIXELS})")
            image = image.resize((w, h), resample=self.resample)
        x = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
        if self.do_center_crop:
            x = _center_crop(x, int(self.crop_size["height"]), int(self.crop_size["width"]))
        out = rescale_normalize(x.transpose(1, 2, 0), self.rescale_factor if self.do_rescale else None,
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
        n = self.num_image_tokens
        for slot, image in zip(slots, images):
            ids.extend(token_ids[last:slot])
            start = len(ids)
            ids.extend([self.image_token_id] * n)
            last = slot + 1
            h = content_hash(image.tobytes(), image.size, image.mode, *self.settings)
            features.append(ImageFeature(h, np.arange(start, start + n, dtype=np.int64),
                                         {"pixel_values": self.pixels(image)}))
        ids.extend(token_ids[last:])
        return MultiModalPrompt(ids, features)


def _triple(v: Any) -> tuple[float, float, float]:
    vals = [float(x) for x in v] if isinstance(v, list | tuple) else [float(v)] * 3
    if len(vals) != 3:
        raise ModelFormatError(f"image mean/std {v!r}: three channels expected")
    return vals[0], vals[1], vals[2]


def _center_crop(x: np.ndarray, ch: int, cw: int) -> np.ndarray:
    """transformers' center_crop: the centered window, zero-padded (centered) where the image is smaller."""
    _, h, w = x.shape
    top, left = (h - ch) // 2, (w - cw) // 2
    if top >= 0 and left >= 0 and top + ch <= h and left + cw <= w:
        return x[:, top:top + ch, left:left + cw]
    nh, nw = max(ch, h), max(cw, w)
    padded = np.zeros((x.shape[0], nh, nw), dtype=x.dtype)
    tp, lp = -(-(nh - h) // 2), -(-(nw - w) // 2)
    padded[:, tp:tp + h, lp:lp + w] = x
    top, left = top + tp, left + lp
    return padded[:, max(0, top):min(nh, top + ch), max(0, left):min(nw, left + cw)]


def image_token_id(hf_config: dict, tokenizer: Tokenizer | None) -> int:
    token = hf_config.get("image_token_index", hf_config.get("image_token_id"))
    if token is None and tokenizer is not None:
        token = tokenizer.hf.token_to_id(IMAGE_TOKEN)
    if token is None:
        raise ModelFormatError(f"the LLaVA config names no image_token_index and the tokenizer has no {IMAGE_TOKEN}")
    return int(token)


def build(hf_config: dict, preprocessor: dict, weights: Iterable[tuple[str, torch.Tensor]],
          tokenizer: Tokenizer) -> LlavaVision | PixtralVision:
    if (hf_config.get("vision_config") or {}).get("model_type") == "pixtral":  # Pixtral-12B
        return pixtral.build(hf_config, preprocessor, weights, tokenizer, llava=True)
    from runlm.models.vision.llava_tower import LlavaVision

    vc = vision_config(hf_config)
    clip = vc["model_type"] == "clip_vision_model"
    layer = hf_config.get("vision_feature_layer", -2)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ModelFormatError(f"vision_feature_layer {layer!r}: runlm reads one layer (an int), not several")
    n = int(vc["num_hidden_layers"])
    if not -(n + 1) <= layer <= n:
        raise ModelFormatError(f"vision_feature_layer {layer} is outside the tower's {n} layers")
    strategy = hf_config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ModelFormatError(f"vision_feature_select_strategy {strategy!r} is not supported")
    drop_first = strategy == "default"  # transformers drops the first token (CLIP's class token)
    weights = list(weights)
    # the decoder's width: the projector's own shape (an mmproj file has no text_config), else the config's
    projector = "multi_modal_projector.linear_2.weight"
    text_hidden = (next((int(t.shape[0]) for name, t in weights if name.endswith(projector)), None)
                   or int(text_config(hf_config)["hidden_size"]))
    image_size = int(vc["image_size"])
    tokens = (image_size // int(vc["patch_size"])) ** 2 + int(clip) - int(drop_first)
    processor = LlavaImageProcessor(preprocessor, image_token_id(hf_config, tokenizer), tokens, image_size, not clip)
    # hidden_states[layer] (an index into the embeddings + each layer's output): never the final norm
    model = LlavaVision(vc, clip, layer % (n + 1), drop_first, text_hidden, hf_config.get("projector_hidden_act",
                        "gelu"), bool(hf_config.get("multimodal_projector_bias", True)), processor)
    model.load_hf(weights)
    return model.eval()
