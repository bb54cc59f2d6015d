"""Qwen2.5-VL: a windowed-attention vision transformer whose patches are merged 2x2 into the text model's rows,
and M-RoPE positions (time, height, width) for the text model.

Processor (transformers' Qwen2VLImageProcessor): each image is resized to multiples of patch_size * merge_size
within [min_pixels, max_pixels] (``smart_resize``, bicubic), rescaled and normalized (CLIP's mean and std), and
cut into patches of temporal_patch_size copies of the frame: ``pixel_values`` [t*h*w, C*T*P*P] in merge-block
order, ``grid_thw`` (1, h, w). The chat template's one ``<|image_pad|>`` per image becomes h*w/merge^2 of them,
and the prompt's M-RoPE positions are those of the model's ``get_rope_index``: text tokens count on all three
axes, an image's tokens take (start, start + row, start + column), and the text after it starts at
start + max(rows, columns).

Tower (Qwen2_5_VisionTransformerPretrainedModel): the Conv3d patch embedding (a matmul over the flattened
patch), a 2-D rotary embedding (rows on one half of each head's frequencies, columns on the other), blocks of
RMSNorm + attention + RMSNorm + SwiGLU, attention within windows of window_size pixels except in
``fullatt_block_indexes`` (whole image), the tokens reordered window by window and back, and the PatchMerger
(RMSNorm, then an MLP over each 2x2 block) to the text hidden size. Several images share one pass; attention
never crosses from one image to another.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runlm.formats import ModelFormatError
from runlm.models.vision.images import ImageError, rescale_normalize
from runlm.models.vision.inputs import ImageFeature, MultiModalPrompt, content_hash

if TYPE_CHECKING:
    from PIL.Image import Image

    from runlm.formats.tokenizer import Tokenizer

MODEL_TYPES = ("qwen2_5_vl",)
PROJECTOR_TYPES = ("qwen2.5vl_merger",)  # llama.cpp's clip.projector_type (tools/mtmd/clip-impl.h)

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_DEFAULT_MROPE_SECTION = [16, 24, 24]  # transformers' Qwen2_5_VLRotaryEmbedding default
_DEFAULT_TEXT_THETA = 1000000.0        # Qwen2_5_VLTextConfig.default_theta
_NOT_TEXT = ("vision_config", "text_config", "architectures", "model_type", "auto_map", "quantization_config")


# ---- the text decoder ---------------------------------------------------------------------------------------
def text_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """A Qwen2 decoder's config with M-RoPE: the rope scaling {"rope_type": "mrope", "mrope_section": [...]} (or
    another type's with the section), from a transformers 5 config (``text_config``) or a flat older one."""
    text = {k: v for k, v in hf_config.items() if k not in _NOT_TEXT}
    text.update(hf_config.get("text_config") or {})
    scaling = dict(text.pop("rope_scaling", None) or text.pop("rope_parameters", None) or {})
    text.pop("rope_parameters", None)
    theta = scaling.pop("rope_theta", None)
    theta = text.get("rope_theta") or theta or _DEFAULT_TEXT_THETA
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    section = list(scaling.pop("mrope_section", None) or _DEFAULT_MROPE_SECTION)
    rope = {"rope_type": "mrope" if kind in ("mrope", "default") else kind, **scaling, "mrope_section": section}
    nested = hf_config.get("text_config") or {}
    tie = bool(hf_config.get("tie_word_embeddings") or nested.get("tie_word_embeddings"))
    return {**text, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": float(theta),
            "rope_scaling": rope, "tie_word_embeddings": tie}


def text_weight(name: str) -> str | None:
    """``model.language_model.X`` (transformers 5) or ``model.X`` (the flat layout) -> ``model.X``; the tower's
    (``model.visual.*``, ``visual.*``) -> None."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith(("model.visual.", "visual.")):
        return None
    if name.startswith("model.") or name == "lm_head.weight":
        return name
    return None


# ---- the processor ------------------------------------------------------------------------------------------
def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: both sides multiples of ``factor``, the area within [min_pixels, max_pixels],
    the aspect ratio kept as nearly as may be."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"the image is {width}x{height}; its aspect ratio must be under 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2VLProcessor:
    """Images into pixel patches and the prompt's expanded placeholders and M-RoPE positions."""

    def __init__(self, preprocessor: Mapping[str, Any], image_token_id: int, spatial_merge_size: int | None = None,
                 patch_size: int | None = None, temporal_patch_size: int | None = None) -> None:
        p = preprocessor
        size = p.get("size") or {}
        self.patch_size = int(p.get("patch_size") or patch_size or 14)
        self.merge_size = int(p.get("merge_size") or spatial_merge_size or 2)
        self.temporal_patch_size = int(p.get("temporal_patch_size") or temporal_patch_size or 2)
        # transformers: min_pixels / max_pixels win over size's shortest_edge / longest_edge
        self.min_pixels = int(p.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56)
        self.max_pixels = int(p.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
                              or 28 * 28 * 1280)
        self.do_resize = bool(p.get("do_resize", True))
        self.resample = int(p.get("resample", 3))  # PIL's BICUBIC
        self.rescale = float(p.get("rescale_factor", 1 / 255)) if p.get("do_rescale", True) else None
        normalize = p.get("do_normalize", True)
        self.mean = np.asarray(p.get("image_mean") or _CLIP_MEAN, dtype=np.float32) if normalize else None
        self.std = np.asarray(p.get("image_std") or _CLIP_STD, dtype=np.float32) if normalize else None
        self.image_token_id = image_token_id

    @property
    def settings(self) -> tuple:
        """What of the processor changes the tower's input (part of each image's hash)."""
        return ("qwen2_5_vl", self.patch_size, self.merge_size, self.temporal_patch_size, self.min_pixels,
                self.max_pixels, self.do_resize, self.resample, self.rescale,
                None if self.mean is None else self.mean.tolist(), None if self.std is None else self.std.tolist())

    def pixel_values(self, image: Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(pixel_values [h*w, C*T*P*P] float32, grid (1, h, w)) as Qwen2VLImageProcessor computes them."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        if self.do_resize:
            height, width = smart_resize(image.height, image.width, p * m, self.min_pixels, self.max_pixels)
            image = image.resize((width, height), resample=self.resample)
        elif image.height % (p * m) or image.width % (p * m):
            raise ImageError(f"the image is {image.width}x{image.height}; without resizing, its sides must be "
                             f"multiples of {p * m}")
        x: np.ndarray = rescale_normalize(np.asarray(image), self.rescale, self.mean, self.std).transpose(2, 0, 1)
        c, h, w = x.shape
        gh, gw = h // p, w // p
        patches = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], tp, p, p))
        return np.ascontiguousarray(patches.reshape(gh * gw, c * tp * p * p), dtype=np.float32), (1, gh, gw)

    def process(self, token_ids: list[int], images: list[Image]) -> MultiModalPrompt:
        """Each image's ``<|image_pad|>`` (one, or a run of exactly its token count) expanded to its tokens."""
        runs = _runs(token_ids, self.image_token_id)
        if len(runs) != len(images):
            raise ImageError(f"the prompt has {len(runs)} image placeholders and {len(images)} images")
        ids: list[int] = []
        features: list[ImageFeature] = []
        done = 0
        for (start, end), image in zip(runs, images):
            pixels, grid = self.pixel_values(image)
            n = grid[0] * grid[1] * grid[2] // self.merge_size ** 2
            if end - start not in (1, n):
                raise ImageError(f"an image placeholder of {end - start} tokens; the image takes {n}")
            ids += token_ids[done:start]
            positions = np.arange(len(ids), len(ids) + n, dtype=np.int64)
            ids += [self.image_token_id] * n
            done = end
            digest = content_hash(image.tobytes(), image.size, image.mode, *self.settings)
            features.append(ImageFeature(digest, positions, {"pixel_values": pixels,
                                                             "grid_thw": np.asarray(grid, dtype=np.int64)}))
        ids += token_ids[done:]
        mrope, delta = self.mrope_positions(len(ids), features)
        return MultiModalPrompt(ids, features, mrope, delta)

    def mrope_positions(self, length: int, features: list[ImageFeature]) -> tuple[np.ndarray, int]:
        """int64 [3, length] positions and the delta of the tokens after them (transformers' get_rope_index)."""
        out = np.empty((3, length), dtype=np.int64)
        index = current = 0
        for f in features:
            text = f.start - index
            out[:, index:f.start] = np.arange(current, current + text, dtype=np.int64)
            current += text
            t, h, w = (int(v) for v in f.data["grid_thw"])
            gh, gw = h // self.merge_size, w // self.merge_size
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            out[:, f.start:f.end] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + current
            current += max(h, w) // self.merge_size
            index = f.end
        out[:, index:] = np.arange(current, current + length - index, dtype=np.int64)
        return out, int(out.max()) + 1 - length if length else 0


def _runs(token_ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of ``token``."""
    ids = np.asarray(token_ids, dtype=np.int64)
    hit = np.concatenate([[False], ids == token, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]


# ---- the tower ----------------------------------------------------------------------------------------------
class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Kernel(nn.Module):
    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class _PatchEmbed(nn.Module):
    """The Conv3d whose kernel is its stride: one matmul of each flattened patch by the flattened kernel."""

    def __init__(self, channels: int, temporal: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = _Kernel(dim, channels, temporal, patch, patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return x.to(w.dtype) @ w.reshape(w.shape[0], -1).T


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, dim = x.shape
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 2, 0, 3).unbind(0)  # [H, N, D] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # attention within each window (or image)
            out[:, a:b] = F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b])
        return self.proj(out.transpose(0, 1).reshape(n, dim))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        if act not in _ACTIVATIONS:
            raise ModelFormatError(f"Qwen2.5-VL vision: unsupported hidden_act {act!r}")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, act: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = _RMSNorm(dim), _RMSNorm(dim)
        self.attn = _Attention(dim, heads)
        self.mlp = _MLP(dim, hidden, act)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = _RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


def _patch_size(cfg: Mapping[str, Any]) -> int:
    """(the Hub's Qwen2.5-VL configs also name it spatial_patch_size, and the channels in_chans)"""
    return int(cfg.get("patch_size") or cfg.get("spatial_patch_size") or 14)


class Qwen2_5_VisionTransformer(nn.Module):
    """Parameters named as in transformers' Qwen2_5_VisionTransformerPretrainedModel (``visual.`` removed)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        dim, heads = int(cfg.get("hidden_size", 1280)), int(cfg.get("num_heads", 16))
        self.patch_size = _patch_size(cfg)
        self.merge = int(cfg.get("spatial_merge_size", 2))
        self.window_size = int(cfg.get("window_size", 112))
        if self.window_size // self.merge // self.patch_size < 1:
            raise ModelFormatError(f"Qwen2.5-VL vision: a window of {self.window_size} pixels holds no merged patch")
        self.fullatt = {int(i) for i in cfg.get("fullatt_block_indexes", (7, 15, 23, 31))}
        self.head_dim = dim // heads
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)
        quarter = self.head_dim // 2  # the rotary frequencies of each axis: head_dim / 4
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        channels = int(cfg.get("in_channels") or cfg.get("in_chans") or 3)
        self.patch_embed = _PatchEmbed(channels, int(cfg.get("temporal_patch_size", 2)), self.patch_size, dim)
        act = str(cfg.get("hidden_act", "silu"))
        self.blocks = nn.ModuleList(_Block(dim, heads, int(cfg.get("intermediate_size", 3420)), act)
                                    for _ in range(int(cfg.get("depth", 32))))
        self.merger = _Merger(int(cfg.get("out_hidden_size", 3584)), dim, self.merge)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [sum t*h*w, C*T*P*P] of several images, their grids -> [sum t*h*w / merge^2, out_hidden], in
        each image's row-major order of merged tokens."""
        unit = self.merge * self.merge
        window_index, cu_windows = _window_index(grids, self.merge, self.window_size // self.merge // self.patch_size)
        cu_images = np.concatenate([[0], np.cumsum([h * w for t, h, w in grids for _ in range(t)])]).tolist()
        order = torch.from_numpy(window_index).to(pixels.device)
        x = self.patch_embed(pixels)
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
        freqs = self._rotary(grids).to(x.device)
        freqs = freqs.view(n // unit, unit, -1)[order].reshape(n, -1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for i, block in enumerate(self.blocks):
            x = block(x, cu_images if i in self.fullatt else cu_windows, cos, sin)
        return self.merger(x)[torch.argsort(order)]

    def _rotary(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[N, head_dim / 2]: each patch's row frequencies then its column frequencies (merge-block order)."""
        m, rows = self.merge, []
        for t, h, w in grids:
            grid_h, grid_w = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
            hh = grid_h.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).ravel()
            ww = grid_w.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).ravel()
            rows.append(np.tile(np.stack([hh, ww], axis=-1), (t, 1)))
        pos = torch.from_numpy(np.concatenate(rows)).float()  # [N, 2]
        return (pos[..., None] * self.inv_freq).flatten(1)

    @torch.no_grad()
    def load_hf(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        seen = set()
        for name, tensor in weights:
            if name not in params:
                raise ModelFormatError(f"unexpected Qwen2.5-VL vision weight {name!r}")
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise ModelFormatError(f"Qwen2.5-VL vision weight {name}: shape {tuple(tensor.shape)}, expected "
                                       f"{tuple(p.shape)}")
            p.copy_(tensor.float())
            seen.add(name)
        missing = [n for n in params if n not in seen]
        if missing:
            raise ModelFormatError(f"the checkpoint lacks {len(missing)} Qwen2.5-VL vision weights, e.g. {missing[:3]}")


def _window_index(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """transformers' get_vision_window_index: the merged tokens' order window by window, and the windows' patch
    boundaries (cumulative)."""
    index, cu, offset = [], [0], 0
    unit = merge * merge
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        ids = np.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = window - gh % window, window - gw % window
        nh, nw = (gh + pad_h) // window, (gw + pad_w) // window
        padded = np.pad(ids, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-100)
        padded = padded.reshape(t, nh, window, nw, window).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, window, window)
        sizes = (padded != -100).sum(axis=(2, 3)).ravel()
        flat = padded.ravel()
        index.append(flat[flat != -100] + offset)
        for s in np.cumsum(sizes) * unit + cu[-1]:
            if s != cu[-1]:  # (empty windows of the padding)
                cu.append(int(s))
        offset += t * gh * gw
    return np.concatenate(index).astype(np.int64), cu


class Qwen2_5_VLVision(nn.Module):
    """The tower and its processor: the family's VisionModel."""
    uses_mrope = True

    def __init__(self, vision_cfg: Mapping[str, Any], processor: Qwen2VLProcessor) -> None:
        super().__init__()
        self.visual = Qwen2_5_VisionTransformer(vision_cfg)
        self.processor = processor

    @torch.no_grad()
    def encode(self, features: list[ImageFeature]) -> list[torch.Tensor]:
        if not features:
            return []
        device = self.visual.merger.ln_q.weight.device
        pixels = torch.cat([torch.from_numpy(np.asarray(f.data["pixel_values"], dtype=np.float32))
                            for f in features]).to(device)
        grids = [tuple(int(v) for v in f.data["grid_thw"]) for f in features]
        out = self.visual(pixels, grids).float()
        return list(out.split([f.num_embeds for f in features]))


def build(hf_config: Mapping[str, Any], preprocessor: Mapping[str, Any], weights: Iterable[tuple[str, torch.Tensor]],
          tokenizer: Tokenizer) -> Qwen2_5_VLVision:
    vision_cfg = dict(hf_config.get("vision_config") or {})
    image_token = hf_config.get("image_token_id")
    if image_token is None:
        image_token = tokenizer.hf.token_to_id("<|image_pad|>")
    if image_token is None:
        raise ModelFormatError("Qwen2.5-VL: neither the config's image_token_id nor the tokenizer's <|image_pad|>")
    processor = Qwen2VLProcessor(preprocessor, int(image_token), vision_cfg.get("spatial_merge_size"),
                                 _patch_size(vision_cfg), vision_cfg.get("temporal_patch_size"))
    if (processor.patch_size, processor.merge_size, processor.temporal_patch_size) != \
            (_patch_size(vision_cfg), int(vision_cfg.get("spatial_merge_size", 2)),
             int(vision_cfg.get("temporal_patch_size", 2))):
        raise ModelFormatError("Qwen2.5-VL: the image processor's patch, merge or temporal size is not the tower's")
    model = Qwen2_5_VLVision(vision_cfg, processor)
    model.visual.load_hf((_strip(name), tensor) for name, tensor in weights)
    return model.eval()


def _strip(name: str) -> str:
    for prefix in ("model.visual.", "visual."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name
