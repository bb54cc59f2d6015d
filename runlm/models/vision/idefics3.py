"""SmolVLM / Idefics3: a SigLIP tower on square tiles, pixel shuffle, one linear projection into a Llama.

An image is resized so its longest edge is ``size["longest_edge"]``, then up to multiples of the tile size
(``max_image_size["longest_edge"]``) and cut into rows x cols tiles, followed by the whole image resized to
one tile (the "global image"); with splitting off, or an image no larger than a tile, only the global image.
Each tile becomes ``image_seq_len`` rows of embeddings: the tower's patches, pixel-shuffled by
``scale_factor`` (each s x s block of patches concatenated) and projected (``connector.modality_projection``).

The chat template writes ``<image>``; the processor expands it, in token-id space, exactly as transformers'
Idefics3Processor expands the text::

    <fake_token_around_image><row_1_col_1><image>*n ... <fake_token_around_image><row_1_col_C><image>*n \\n
    ...                                                                                               \\n
    \\n<fake_token_around_image><global-img><image>*n<fake_token_around_image>

(the last row's newline and the one before the global image tokenize together, as ``\\n\\n``). Only the
``<image>`` tokens take the tower's rows; the tile markers between them stay text. Both model types use
it: ``idefics3`` (SmolVLM, Idefics3) and ``smolvlm`` (SmolVLM2's images; its video input is not read).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from runlm.models.vision.images import ImageError, rescale_normalize
from runlm.models.vision.inputs import ImageFeature, MultiModalPrompt, content_hash
from runlm.models.vision.vit import VisionTransformer, ViTConfig

if TYPE_CHECKING:
    from PIL.Image import Image

    from runlm.formats.tokenizer import Tokenizer

MODEL_TYPES = ("idefics3", "smolvlm")
PROJECTOR_TYPES = ("idefics3",)

_TEXT_PREFIXES = ("model.text_model.", "text_model.")
_MAX_IMAGE_SIZE = 4096  # transformers' bound on the resized image's longest edge
_LANCZOS = 1            # PIL's Resampling.LANCZOS: Idefics3ImageProcessor's default


def text_config(hf_config: dict) -> dict:
    """The Llama (SmolLM2, Llama 3) inside: transformers reads the top-level ``tie_word_embeddings`` for the
    conditional-generation model, and defaults the text model's ``rms_norm_eps`` to 1e-5."""
    cfg = dict(hf_config.get("text_config") or {})
    cfg.setdefault("model_type", "llama")
    cfg.setdefault("rms_norm_eps", 1e-5)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["tie_word_embeddings"] = bool(hf_config.get("tie_word_embeddings", False))
    return cfg


def text_weight(name: str) -> str | None:
    """``model.text_model.X`` (Idefics3ForConditionalGeneration) or ``text_model.X`` (a bare Idefics3Model)
    -> ``model.X``; ``lm_head.weight`` as is; the tower's and connector's -> None."""
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name if name == "lm_head.weight" else None


def _edge(spec: Any, what: str) -> int:
    if isinstance(spec, dict) and "longest_edge" in spec:
        return int(spec["longest_edge"])
    if isinstance(spec, int | float):
        return int(spec)
    raise ValueError(f"preprocessor {what}: expected {{'longest_edge': N}}, got {spec!r}")


def _rescale_to_max_len(h: int, w: int, max_len: int) -> tuple[int, int]:
    """transformers' _resize_output_size_rescale_to_max_len: the longest edge becomes max_len (up or down),
    the other keeps the aspect ratio, rounded up to even."""
    aspect = w / h
    if w >= h:
        w = max_len
        h = int(w / aspect)
        h += h % 2
    else:
        h = max_len
        w = int(h * aspect)
        w += w % 2
    return max(h, 1), max(w, 1)


def _scale_below(h: int, w: int, max_len: int) -> tuple[int, int]:
    aspect = w / h
    if w >= h and w > max_len:
        w, h = max_len, int(max_len / aspect)
    elif h > w and h > max_len:
        h, w = max_len, int(max_len * aspect)
    return max(h, 1), max(w, 1)


def _multiple_of_tile(h: int, w: int, tile: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder: both edges up to multiples of the tile."""
    aspect = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / aspect) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * aspect) / tile) * tile
    return h, w


class Idefics3ImageProcessor:
    """Idefics3ImageProcessor (PIL backend: every resize is Pillow's, on 8-bit pixels) + Idefics3Processor's
    prompt expansion, in token ids."""

    def __init__(self, preprocessor: dict, tokenizer: Tokenizer, image_token_id: int, image_seq_len: int) -> None:
        p = preprocessor
        self.do_resize = bool(p.get("do_resize", True))
        size = p.get("size") or {"longest_edge": 4 * 364}
        self.size: tuple[int, int] | int = ((int(size["height"]), int(size["width"]))
                                            if isinstance(size, dict) and "longest_edge" not in size
                                            else _edge(size, "size"))
        self.tile = _edge(p.get("max_image_size") or {"longest_edge": 364}, "max_image_size")
        self.do_split = bool(p.get("do_image_splitting", True))
        self.resample = int(p.get("resample", _LANCZOS))
        self.do_rescale = bool(p.get("do_rescale", True))
        self.rescale_factor = float(p.get("rescale_factor", 1 / 255))
        self.do_normalize = bool(p.get("do_normalize", True))
        mean, std = p.get("image_mean", [0.5, 0.5, 0.5]), p.get("image_std", [0.5, 0.5, 0.5])
        self.mean = np.array([mean] * 3 if isinstance(mean, int | float) else mean, dtype=np.float32)
        self.std = np.array([std] * 3 if isinstance(std, int | float) else std, dtype=np.float32)
        self.image_seq_len = image_seq_len
        self.image_token_id = image_token_id

        def ids(text: str) -> list[int]:  # a piece as the processor's tokenizer call sees it, between special tokens
            return tokenizer.encode(text, add_special_tokens=False)

        self._fake = ids("<fake_token_around_image>")
        self._global = ids("<global-img>")
        self._newline, self._newlines = ids("\n"), ids("\n\n")
        self._row_col = {(r, c): ids(f"<row_{r}_col_{c}>") for r in range(1, 7) for c in range(1, 7)}
        self._settings = (self.do_resize, self.size, self.tile, self.do_split, self.resample, self.do_rescale,
                          self.rescale_factor, self.do_normalize, self.mean.tolist(), self.std.tolist())

    # -- pixels ---------------------------------------------------------------------------------------
    def _resize(self, image: Image, h: int, w: int) -> Image:
        return image.resize((w, h), resample=self.resample)

    def tiles(self, image: Image) -> tuple[np.ndarray, int, int]:
        """The tower's input for one RGB image: float32 [tiles, 3, tile, tile] (rows x cols tiles in row-major
        order, then the global image), rows, cols (0, 0: the global image alone)."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        if self.do_resize:
            if isinstance(self.size, tuple):
                h, w = self.size
            else:
                h, w = _rescale_to_max_len(image.height, image.width, self.size)
                h, w = _scale_below(h, w, _MAX_IMAGE_SIZE)
            image = self._resize(image, h, w)
        t = self.tile
        rows = cols = 0
        if self.do_split:
            h, w = _multiple_of_tile(image.height, image.width, t)
            if h > t or w > t:
                rows, cols = (h - t) // t + 1, (w - t) // t + 1
            if rows > 6 or cols > 6:  # the tokenizer names tiles up to <row_6_col_6>
                raise ImageError(f"the image would be split into {rows} x {cols} tiles; the most is 6 x 6 tiles")
            image = self._resize(image, h, w)
        arrays = []
        if rows:
            whole = np.asarray(image)
            arrays = [whole[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
        arrays.append(np.asarray(self._resize(image, t, t)))
        pixels = np.stack(arrays)  # [n, t, t, 3] uint8
        out = rescale_normalize(pixels, self.rescale_factor if self.do_rescale else None,
                                *((self.mean, self.std) if self.do_normalize else ()))
        return np.ascontiguousarray(out.transpose(0, 3, 1, 2)), rows, cols

    # -- tokens ---------------------------------------------------------------------------------------
    def _expansion(self, rows: int, cols: int) -> list[int]:
        n = self.image_seq_len
        out: list[int] = []
        for r in range(rows):
            for c in range(cols):
                out += self._fake + self._row_col[(r + 1, c + 1)] + [self.image_token_id] * n
            out += self._newline if r < rows - 1 else self._newlines
        return out + self._fake + self._global + [self.image_token_id] * n + self._fake

    def process(self, token_ids: list[int], images: list[Image]) -> MultiModalPrompt:
        places = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(places) != len(images):
            raise ImageError(f"the prompt has {len(places)} image placeholders (<image>) for {len(images)} images")
        ids: list[int] = []
        features = []
        start = 0
        for place, image in zip(places, images):
            pixels, rows, cols = self.tiles(image)
            ids += token_ids[start:place]
            expansion = np.asarray(self._expansion(rows, cols), dtype=np.int64)
            positions = len(ids) + np.flatnonzero(expansion == self.image_token_id)
            ids += expansion.tolist()
            start = place + 1
            features.append(ImageFeature(
                hash=content_hash(image.tobytes(), image.size, image.mode, *self._settings),
                positions=positions.astype(np.int64), data={"pixel_values": pixels, "rows": rows, "cols": cols}))
        ids += token_ids[start:]
        return MultiModalPrompt(ids, features)


class _Projection(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(n_in, n_out, bias=False)


class Connector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = _Projection(vision_hidden * scale * scale, text_hidden)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """Idefics3Connector.pixel_shuffle, step for step: each s x s block of patches, concatenated."""
        b, seq, d = x.shape
        s = self.scale
        side = int(seq ** 0.5)
        x = x.view(b, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(b, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return x.reshape(b, seq // (s * s), d * s * s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(self.pixel_shuffle(x))


def _position_ids(per_side: int, grid: int) -> torch.Tensor:
    """Idefics3VisionEmbeddings' position ids for a full grid x grid tile: each patch's fractional coordinate
    bucketed into the per_side x per_side learned positions. Computed as transformers does, in float32 on
    the CPU: for some sizes (19, 25, 29, ...) the buckets are not simply 0..grid-1."""
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    step = 1.0 / torch.tensor([grid])
    frac = torch.clamp(torch.arange(grid, dtype=torch.float32)[None, :] * step[:, None], max=1.0 - 1e-6)
    bucket = torch.bucketize(frac, boundaries, right=True)[0]
    return (bucket[:, None] * per_side + bucket[None, :]).reshape(-1)


class Idefics3Vision(nn.Module):
    """The SigLIP tower (``vision_model``) and the pixel-shuffle projector (``connector``) of Idefics3Model."""
    uses_mrope = False

    def __init__(self, hf_config: dict, processor: Idefics3ImageProcessor) -> None:
        super().__init__()
        vcfg = hf_config["vision_config"]
        self.vit = ViTConfig.from_hf(vcfg)
        self.scale = int(hf_config.get("scale_factor", 2))
        self.processor = processor
        grid = processor.tile // self.vit.patch_size
        if grid % self.scale:
            raise ValueError(f"a {processor.tile}-pixel tile is {grid} patches a side, not a multiple of the "
                             f"scale factor {self.scale}")
        text_hidden = int(hf_config["text_config"]["hidden_size"])
        self.vision_model = VisionTransformer(self.vit)
        self.connector = Connector(self.vit.hidden_size, text_hidden, self.scale)
        self.register_buffer("position_ids", _position_ids(self.vit.image_size // self.vit.patch_size, grid),
                             persistent=False)

    def tower(self, pixels: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, tile, tile] -> [tiles, image_seq_len, text hidden]."""
        vm = self.vision_model
        emb = vm.embeddings
        x = emb.patch_embedding(pixels.to(emb.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = x + emb.position_embedding(self.position_ids)
        for layer in vm.encoder.layers:
            x = layer(x)
        assert vm.post_layernorm is not None
        return self.connector(vm.post_layernorm(x))

    @torch.no_grad()
    def encode(self, features: Sequence[ImageFeature]) -> list[torch.Tensor]:
        """All the images' tiles in one pass; each image's rows are its tiles' in order, the global image last."""
        if not features:
            return []
        device = self.connector.modality_projection.proj.weight.device
        pixels = torch.from_numpy(np.concatenate([f.data["pixel_values"] for f in features])).to(device)
        out = self.tower(pixels).float()
        counts = [int(f.data["pixel_values"].shape[0]) for f in features]
        return [rows.reshape(-1, rows.shape[-1]) for rows in out.split(counts)]

    @torch.no_grad()
    def load_hf(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision = []
        proj = None
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("vision_model."):
                vision.append((name[len("vision_model."):], tensor))
            elif name == "connector.modality_projection.proj.weight":
                proj = tensor
            else:
                raise KeyError(f"unexpected Idefics3 weight {name!r}")
        self.vision_model.load_hf(vision)
        p = self.connector.modality_projection.proj.weight
        if proj is None:
            raise KeyError("the checkpoint lacks connector.modality_projection.proj.weight")
        if tuple(proj.shape) != tuple(p.shape):
            raise RuntimeError(f"connector.modality_projection.proj.weight: shape {tuple(proj.shape)}, "
                               f"expected {tuple(p.shape)}")
        p.copy_(proj.float())


def build(hf_config: dict, preprocessor: dict, weights: Iterable[tuple[str, torch.Tensor]],
          tokenizer: Tokenizer) -> Idefics3Vision:
    vcfg = hf_config["vision_config"]
    scale = int(hf_config.get("scale_factor", 2))
    tile = _edge(preprocessor.get("max_image_size") or {"longest_edge": 364}, "max_image_size")
    grid = tile // int(vcfg["patch_size"])
    image_token_id = tokenizer.hf.token_to_id("<image>")
    if image_token_id is None:
        image_token_id = int(hf_config.get("image_token_id", 128257))
    processor = Idefics3ImageProcessor(preprocessor, tokenizer, image_token_id, (grid // scale) ** 2)
    model = Idefics3Vision(hf_config, processor)
    model.load_hf(weights)
    return model.eval()
