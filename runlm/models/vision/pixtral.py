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
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runlm.formats import ModelFormatError
from runlm.models.vision.images import ImageError
from runlm.models.vision.inputs import ImageFeature, MultiModalPrompt, content_hash

if TYPE_CHECKING:
    from PIL.Image import Image

    from runlm.formats.tokenizer import Tokenizer

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

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


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
        x = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
        out = (x.astype(np.float64) * self.rescale_factor).astype(np.float32) if self.do_rescale \
            else x.astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
            std = np.asarray(self.std, dtype=np.float32)[:, None, None]
            out = (out - mean) / std
        return np.ascontiguousarray(out, dtype=np.float32)

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


# ---- the tower -----------------------------------------------------------------------------------------------
class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return self.o_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, h))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        if act not in _ACTIVATIONS:
            raise ModelFormatError(f"Pixtral hidden_act {act!r} is not supported")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.attention_norm = _RMSNorm(c["hidden_size"], 1e-5)
        self.attention = _Attention(c["hidden_size"], c["num_attention_heads"])
        self.ffn_norm = _RMSNorm(c["hidden_size"], 1e-5)
        self.feed_forward = _MLP(c["hidden_size"], c["intermediate_size"], c["hidden_act"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class _Transformer(nn.Module):
    def __init__(self, c: dict, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(c) for _ in range(layers))


class PixtralTower(nn.Module):
    """forward(pixels [B, C, H, W], one size for the batch) -> [B, (H/p) * (W/p), hidden]: the output of layer
    ``keep`` (hidden_states[keep]; the layers after it are not built). Names as transformers' PixtralVisionModel."""
    inv_freq: torch.Tensor

    def __init__(self, c: dict, keep: int) -> None:
        super().__init__()
        hidden, self.patch = c["hidden_size"], c["patch_size"]
        self.patch_conv = nn.Conv2d(c["num_channels"], hidden, self.patch, self.patch, bias=False)
        self.ln_pre = _RMSNorm(hidden, 1e-5)
        self.transformer = _Transformer(c, keep)
        head_dim = int(c.get("head_dim") or hidden // c["num_attention_heads"])
        inv = 1.0 / (float(c["rope_theta"]) ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", torch.cat([inv[0::2], inv[1::2]]), persistent=False)

    def rope(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [rows * cols, head_dim]: a patch's row on the first half of the frequencies, its column on
        the second (transformers' PixtralVisionRotaryEmbedding)."""
        hpos, wpos = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        pos = torch.stack([hpos.flatten(), wpos.flatten()], dim=-1).to(self.inv_freq.device)
        freqs = pos[..., None].float() * self.inv_freq  # [N, 2, head_dim / 2]
        quarter = freqs.shape[-1] // 2
        hw = torch.cat([freqs[:, 0, :quarter], freqs[:, 1, quarter:]], dim=-1)
        angles = torch.cat([hw, hw], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.patch_conv.weight
        x = self.patch_conv(pixels.to(w.dtype))  # [B, hidden, rows, cols]
        rows, cols = x.shape[-2:]
        x = self.ln_pre(x.flatten(2).transpose(1, 2))
        cos, sin = self.rope(rows, cols)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.transformer.layers:
            x = layer(x, cos, sin)
        return x


class _PatchMerger(nn.Module):
    def __init__(self, hidden: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(hidden * merge * merge, hidden, bias=False)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """x [rows * cols, hidden] -> [(rows / m) * (cols / m), hidden]: each m x m block's patches, concatenated
        channel-major (torch's unfold, as transformers does), through the merging layer."""
        d = x.shape[-1]
        grid = x.view(rows, cols, d).permute(2, 0, 1).unsqueeze(0)
        blocks = F.unfold(grid, kernel_size=self.merge, stride=self.merge)
        return self.merging_layer(blocks.view(d * self.merge ** 2, -1).t())


class _Projector(nn.Module):
    """Mistral 3's (norm, patch merger, MLP); LLaVA's (the MLP alone) with ``merge`` None."""

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int | None, eps: float, act: str,
                 bias: bool) -> None:
        super().__init__()
        self.norm = _RMSNorm(vision_hidden, eps) if merge is not None else None
        self.patch_merger = _PatchMerger(vision_hidden, merge) if merge is not None else None
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        if act not in _ACTIVATIONS:
            raise ModelFormatError(f"projector_hidden_act {act!r} is not supported")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        if self.norm is not None and self.patch_merger is not None:
            x = self.patch_merger(self.norm(x), rows, cols)
        return self.linear_2(self.act(self.linear_1(x)))


class PixtralVision(nn.Module):
    uses_mrope = False

    def __init__(self, hf_config: dict, preprocessor: dict, ids: tuple[int, int, int],
                 text_hidden: int | None = None, llava: bool = False) -> None:
        """``llava``: Pixtral-12B's shape (model_type ``llava`` with a Pixtral tower): no norm nor patch merger
        before the projector's MLP, whose biases default to on."""
        super().__init__()
        vc = vision_config(hf_config)
        n = int(vc["num_hidden_layers"])
        layer = hf_config.get("vision_feature_layer", -1)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ModelFormatError(f"vision_feature_layer {layer!r}: runlm reads one layer (an int), not several")
        if not -(n + 1) <= layer <= n:
            raise ModelFormatError(f"vision_feature_layer {layer} is outside the tower's {n} layers")
        self.vision_tower = PixtralTower(vc, layer % (n + 1))
        if llava and hf_config.get("vision_feature_select_strategy", "default") != "full":
            raise ModelFormatError("LLaVA with a Pixtral tower reads every patch: vision_feature_select_strategy "
                                   "must be 'full'")
        self.merge = 1 if llava else int(hf_config.get("spatial_merge_size", 2))
        tc = {**_TEXT_DEFAULTS, **(hf_config.get("text_config") or {})}
        self.multi_modal_projector = _Projector(
            int(vc["hidden_size"]), text_hidden or int(tc["hidden_size"]), None if llava else self.merge,
            float(tc["rms_norm_eps"]), hf_config.get("projector_hidden_act", "gelu"),
            bool(hf_config.get("multimodal_projector_bias", llava)))
        self.patch = int(vc["patch_size"])
        self.processor = PixtralImageProcessor(preprocessor, self.patch * self.merge, ids)

    def encode(self, features: Sequence[ImageFeature]) -> list[torch.Tensor]:
        """One tower pass per image size (images of a size batched together: each attends only within itself)."""
        out: list[torch.Tensor | None] = [None] * len(features)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, f in enumerate(features):
            by_shape.setdefault(tuple(f.data["pixel_values"].shape), []).append(i)
        device = self.multi_modal_projector.linear_1.weight.device
        with torch.no_grad():
            for shape, idx in by_shape.items():
                pixels = torch.from_numpy(np.stack([features[i].data["pixel_values"] for i in idx])).to(device)
                hidden = self.vision_tower(pixels)
                rows, cols = shape[1] // self.patch, shape[2] // self.patch
                for i, h in zip(idx, hidden):
                    out[i] = self.multi_modal_projector(h, rows, cols).float()
        return [o for o in out if o is not None]

    @torch.no_grad()
    def load_hf(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = {f"vision_tower.{k}": v for k, v in self.vision_tower.named_parameters()}
        params.update({f"multi_modal_projector.{k}": v for k, v in self.multi_modal_projector.named_parameters()})
        keep = len(self.vision_tower.transformer.layers)
        seen = set()
        for name, tensor in weights:
            base = name.removeprefix("model.")
            if base.startswith("vision_tower.transformer.layers."):
                if int(base.split(".")[3]) >= keep:
                    continue  # a layer past the feature layer
            if base not in params:
                raise ModelFormatError(f"unexpected weight {name!r} in a Mistral 3 checkpoint")
            p = params[base]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ModelFormatError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            p.copy_(tensor.float())
            seen.add(base)
        missing = [k for k in params if k not in seen]
        if missing:
            raise ModelFormatError(f"the checkpoint lacks {len(missing)} vision weights, e.g. {missing[:3]}")


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
    """``llava``: for runlm.models.vision.llava, a ``llava`` config with a Pixtral tower (Pixtral-12B)."""
    weights = list(weights)
    text_hidden = next((int(t.shape[0]) for n, t in weights if n.endswith("multi_modal_projector.linear_2.weight")),
                       None)
    model = PixtralVision(hf_config, preprocessor, token_ids(hf_config, tokenizer), text_hidden, llava)
    model.load_hf(weights)
    return model.eval()
