"""Gemma 3 (Gemma3ForConditionalGeneration): a SigLIP tower, a pooling projector and the Gemma 3 text decoder.

Tower: SigLIP's last layer after its final norm (runlm.models.vision.vit). Projector (transformers'
Gemma3MultiModalProjector): the patches laid out as their grid, average-pooled down to ``mm_tokens_per_image``
soft tokens (a 64 x 64 grid to 16 x 16 on the real models), Gemma's RMSNorm (weight used as 1 + w), then a matmul
by ``mm_input_projection_weight`` into the text model's hidden size. The text model writes these rows over the
token embeddings after its embedding scale (they are not scaled), and its attention lets an image's soft tokens
see each other both ways (transformers' ``token_type_ids`` mask: a block of consecutive image tokens is
bidirectional, text stays causal, local layers keep their window): ``ImageFeature.bidirectional``.

Processor (transformers' Gemma3ImageProcessor with its default settings, pan-and-scan off): resize to ``size``
with ``resample``, rescale by 1/255, normalize with mean and std 0.5. The chat template writes one
``<start_of_image>`` per image; Gemma3Processor replaces its text with ``\\n\\n<start_of_image>`` +
``<image_soft_token>`` x mm_tokens_per_image + ``<end_of_image>\\n\\n`` and tokenizes the whole text again. Here
the same happens to token ids, with the newlines merged into the text beside them as the tokenizer merges them
(``"\\n" + "\\n\\n"`` is one token ``"\\n\\n\\n"`` in Gemma's vocabulary), so the ids equal transformers'.

Importing this module imports no torch (the engine asks every family whether it serves a config); the tower
is built by ``build``.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from runlm.formats import ModelFormatError
from runlm.models.vision.images import ImageError, rescale_normalize
from runlm.models.vision.inputs import ImageFeature, MultiModalPrompt, content_hash

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

    from runlm.formats.tokenizer import Tokenizer

MODEL_TYPES = ("gemma3",)
PROJECTOR_TYPES = ("gemma3",)  # llama.cpp's clip.projector_type of Gemma 3's mmproj files

# transformers' Gemma3TextConfig defaults: the hub's configs leave most of them out of text_config
_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, query_pre_attn_scalar=256,
    sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None,
)
# transformers' SiglipVisionConfig defaults
_VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, num_channels=3,
    image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
)
# Gemma3Config's defaults (the real vocabulary's ids)
_BOI, _EOI, _IMAGE, _MM_TOKENS = 255_999, 256_000, 262_144, 256


def text_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The text decoder's config: ``text_config`` over Gemma3TextConfig's defaults, as Gemma3ForCausalLM."""
    given = hf_config.get("text_config") or {}
    cfg = {**_TEXT_DEFAULTS, **given, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}
    if "rope_parameters" not in given:  # a config from before transformers 5: the bases by their old names
        cfg.setdefault("rope_theta", 1_000_000.0)
        cfg.setdefault("rope_local_base_freq", 10_000.0)
    # Gemma3ForConditionalGeneration ties its lm_head by the top-level flag (real Gemma 3 always ties)
    cfg["tie_word_embeddings"] = bool(hf_config.get("tie_word_embeddings", given.get("tie_word_embeddings", True)))
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):  # the top level's ids win (eos [1, 106] there)
        if hf_config.get(key) is not None:
            cfg[key] = hf_config[key]
    if cfg.get("use_bidirectional_attention"):
        raise ModelFormatError("a Gemma 3 text model with use_bidirectional_attention is an embedding model")
    return cfg


def text_weight(name: str) -> str | None:
    """A checkpoint name as the text decoder knows it: transformers 5's layout (``model.language_model.X``,
    ``lm_head.weight``) or the hub's (``language_model.model.X``, ``language_model.lm_head.weight``); None for
    the tower's and the projector's."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    if name.startswith("language_model.model."):
        return name[len("language_model."):]
    if name.startswith("language_model."):
        return "model." + name[len("language_model."):]
    if name.startswith("lm_head."):
        return name
    return None


def _vision_name(name: str) -> tuple[str, str] | None:
    """("tower" | "projector", the name inside it) of a vision or projector checkpoint name."""
    rest = name[len("model."):] if name.startswith("model.") else name
    if rest.startswith("vision_tower."):
        rest = rest[len("vision_tower."):]
        # the hub's vision_tower.vision_model.X; transformers 5 saves vision_tower.X
        return "tower", rest[len("vision_model."):] if rest.startswith("vision_model.") else rest
    if rest.startswith("multi_modal_projector."):
        return "projector", rest[len("multi_modal_projector."):]
    return None


# ---- processor ----------------------------------------------------------------------------------------------
_RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def _setting(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    value = cfg.get(key)
    return default if value is None else value


class Gemma3ImageProcessor:
    """Gemma3ImageProcessor's default path and Gemma3Processor's expansion of ``<start_of_image>``, on token ids."""

    def __init__(self, preprocessor: Mapping[str, Any], hf_config: Mapping[str, Any], tokenizer: Tokenizer,
                 image_size: int) -> None:
        def refuse(what: str) -> ModelFormatError:
            return ModelFormatError(f"Gemma 3 image processor: runlm supports its default settings only, not {what}")

        if _setting(preprocessor, "do_pan_and_scan", False):
            raise refuse("do_pan_and_scan (pan-and-scan crops)")
        if not _setting(preprocessor, "do_resize", True):
            raise refuse("do_resize false")
        if not _setting(preprocessor, "do_convert_rgb", True):
            raise refuse("do_convert_rgb false")
        size = _setting(preprocessor, "size", {"height": 224, "width": 224})
        if not isinstance(size, Mapping) or set(size) != {"height", "width"}:
            raise refuse(f"size {size!r} (a height and a width)")
        self.size = (int(size["height"]), int(size["width"]))
        if self.size != (image_size, image_size):
            raise ModelFormatError(f"Gemma 3: the image processor resizes to {self.size}, the tower takes "
                                   f"{image_size} x {image_size}")
        self.resample = int(_setting(preprocessor, "resample", 2))
        if self.resample not in _RESAMPLE_NAMES:
            raise refuse(f"resample {self.resample}")
        self.rescale = float(_setting(preprocessor, "rescale_factor", 1 / 255)) \
            if _setting(preprocessor, "do_rescale", True) else None
        mean, std = _setting(preprocessor, "image_mean", [0.5] * 3), _setting(preprocessor, "image_std", [0.5] * 3)
        self.normalize = _setting(preprocessor, "do_normalize", True)
        self.mean = np.array([mean] * 3 if isinstance(mean, int | float) else mean, dtype=np.float32)
        self.std = np.array([std] * 3 if isinstance(std, int | float) else std, dtype=np.float32)
        if self.mean.shape != (3,) or self.std.shape != (3,):
            raise refuse(f"image_mean {mean!r} / image_std {std!r}")

        self.tokenizer = tokenizer

        def token(key: str, text: str, default: int) -> int:  # the config's id, else the tokenizer's, else Gemma's
            found = hf_config.get(key, hf_config.get(key.replace("_index", "_id")))
            found = tokenizer.hf.token_to_id(text) if found is None else found
            return int(default if found is None else found)

        self.boi = token("boi_token_index", "<start_of_image>", _BOI)
        self.eoi = token("eoi_token_index", "<end_of_image>", _EOI)
        self.image_token = token("image_token_index", "<image_soft_token>", _IMAGE)
        self.num_tokens = int(_setting(hf_config, "mm_tokens_per_image", _MM_TOKENS))
        self.newlines = tokenizer.encode("\n\n", add_special_tokens=False)
        # tokens the tokenizer matches whole (special and added ones): never re-tokenized with their neighbours
        self.added = frozenset(tokenizer.hf.get_added_tokens_decoder())
        self.settings = (self.size, self.resample, self.rescale, self.normalize, self.mean.tolist(),
                         self.std.tolist())

    # -- pixels -----------------------------------------------------------------------------------------------
    def pixels(self, image: Image) -> np.ndarray:
        """[3, height, width] float32, as Gemma3ImageProcessor (its PIL backend) computes them."""
        from PIL import Image as PILImage

        h, w = self.size
        resized = image.convert("RGB").resize((w, h), resample=PILImage.Resampling(self.resample))
        x = rescale_normalize(np.asarray(resized), self.rescale, *((self.mean, self.std) if self.normalize else ()))
        return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)

    # -- token ids --------------------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.hf.decode(ids, skip_special_tokens=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.hf.encode(text, add_special_tokens=False).ids

    def _blank(self, token: int) -> bool:
        """A token of whitespace only that the tokenizer may merge with the newlines written beside it."""
        if token in self.added:
            return False
        text = self._decode([token])
        return text != "" and text.isspace()

    def _retokenize(self, ids: list[int], before: bool, after: bool) -> list[int]:
        """A text segment with "\\n\\n" written before it (it follows an image) and/or after it (an image follows),
        tokenized as the tokenizer tokenizes that text: the newlines are encoded again together with the
        segment's whitespace tokens beside them and the one word token past those."""
        n = len(ids)
        head = tail = 0  # how many of the segment's first / last tokens are encoded again with the newlines
        if before:
            while head < n and self._blank(ids[head]):
                head += 1
            head += int(head < n and ids[head] not in self.added)
        if after:
            while tail < n and self._blank(ids[n - 1 - tail]):
                tail += 1
            tail += int(tail < n and ids[n - 1 - tail] not in self.added)
        if before and after and head + tail >= n:
            return self._joined(ids, before=True, after=True)
        return [*(self._joined(ids[:head], before=True, after=False) if before else []), *ids[head:n - tail],
                *(self._joined(ids[n - tail:], before=False, after=True) if after else [])]

    def _joined(self, piece: list[int], before: bool, after: bool) -> list[int]:
        """The newlines and ``piece`` encoded as one text, where ``piece`` is the tokenizer's own encoding of its
        text (ids a client wrote otherwise stay as they are, the newlines' ids beside them)."""
        text = self._decode(piece)
        if piece and self._encode(text) != piece:
            return [*(self.newlines if before else []), *piece, *(self.newlines if after else [])]
        return self._encode(("\n\n" if before else "") + text + ("\n\n" if after else ""))

    def process(self, token_ids: list[int], images: list[Image]) -> MultiModalPrompt:
        places = [i for i, t in enumerate(token_ids) if t == self.boi]
        if len(places) != len(images):
            raise ImageError(f"the prompt has {len(places)} image placeholders (<start_of_image>, which the chat "
                             f"template writes for each image) for {len(images)} images")
        bounds = [-1, *places, len(token_ids)]
        out: list[int] = []
        features = []
        for k, image in enumerate([*images, None]):
            segment = token_ids[bounds[k] + 1:bounds[k + 1]]
            out += self._retokenize(segment, before=k > 0, after=image is not None)
            if image is None:
                break
            out.append(self.boi)
            start = len(out)
            out += [self.image_token] * self.num_tokens
            out.append(self.eoi)
            key = content_hash(image.tobytes(), image.size, image.mode, *self.settings)
            features.append(ImageFeature(key, np.arange(start, start + self.num_tokens, dtype=np.int64),
                                         {"pixel_values": self.pixels(image)}, bidirectional=True))
        return MultiModalPrompt(out, features)


# ---- tower and projector ------------------------------------------------------------------------------------
@functools.cache
def _classes() -> tuple[type, type]:
    import torch
    from torch import nn

    from runlm.models.vision.vit import VisionTransformer, ViTConfig

    class GemmaRMSNorm(nn.Module):
        """Gemma's RMSNorm: the weight is used as 1 + w, computed in float32."""

        def __init__(self, dim: int, eps: float) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(dim))
            self.eps = eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.float()
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())

    class Gemma3Projector(nn.Module):
        """transformers' Gemma3MultiModalProjector: pool the patch grid, RMSNorm (1 + w), project."""

        def __init__(self, vision_hidden: int, text_hidden: int, patches_per_side: int, tokens_per_side: int,
                     eps: float) -> None:
            super().__init__()
            self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision_hidden, text_hidden))
            self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, eps)
            self.side = patches_per_side
            kernel = patches_per_side // tokens_per_side
            self.pool = nn.AvgPool2d(kernel_size=kernel, stride=kernel)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, _, hidden = x.shape
            grid = x.transpose(1, 2).reshape(b, hidden, self.side, self.side).contiguous()
            pooled = self.pool(grid).flatten(2).transpose(1, 2)
            return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)

    class Gemma3Vision(nn.Module):
        uses_mrope = False
        bidirectional_images = True  # the text model attends bidirectionally among an image's tokens

        def __init__(self, vit: ViTConfig, projector: Gemma3Projector, processor: Gemma3ImageProcessor) -> None:
            super().__init__()
            self.vision_tower = VisionTransformer(vit, feature_layer=-1)
            self.multi_modal_projector = projector
            self.processor = processor

        @torch.no_grad()
        def encode(self, features: list[ImageFeature]) -> list[torch.Tensor]:
            if not features:
                return []
            device = self.multi_modal_projector.mm_input_projection_weight.device
            pixels = torch.from_numpy(np.stack([f.data["pixel_values"] for f in features])).to(device)
            rows = self.multi_modal_projector(self.vision_tower(pixels)).float()
            return list(rows.unbind(0))

        @torch.no_grad()
        def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            tower, projector = [], {}
            for name, tensor in weights:
                part = _vision_name(name)
                if part is None:
                    raise ModelFormatError(f"Gemma 3: unexpected weight {name!r}")
                if part[0] == "tower":
                    tower.append((part[1], tensor))
                else:
                    projector[part[1]] = tensor
            try:
                self.vision_tower.load_hf(tower)
            except (KeyError, RuntimeError) as exc:
                raise ModelFormatError(f"Gemma 3 vision tower: {exc}") from None
            params = dict(self.multi_modal_projector.named_parameters())
            if set(projector) != set(params):
                raise ModelFormatError(f"Gemma 3 projector: weights {sorted(projector)}, expected {sorted(params)}")
            for key, p in params.items():
                if tuple(projector[key].shape) != tuple(p.shape):
                    raise ModelFormatError(f"Gemma 3 projector weight {key}: shape {tuple(projector[key].shape)}, "
                                           f"expected {tuple(p.shape)}")
                p.copy_(projector[key].float())

    return Gemma3Projector, Gemma3Vision


def build(hf_config: Mapping[str, Any], preprocessor: Mapping[str, Any],
          weights: Iterable[tuple[str, torch.Tensor]], tokenizer: Tokenizer) -> Any:
    """The tower + projector (float32) and the processor of a Gemma 3 checkpoint (or of what
    runlm.models.vision.mmproj reads from an mmproj file: its config may lack the text model's)."""
    from runlm.models.vision.vit import ViTConfig

    weights = list(weights)
    vision = {**_VISION_DEFAULTS, **(hf_config.get("vision_config") or {})}
    vit = ViTConfig.from_hf(vision)
    projection = [t for n, t in weights if n.endswith("multi_modal_projector.mm_input_projection_weight")]
    if len(projection) != 1:
        raise ModelFormatError("Gemma 3: the checkpoint has no multi_modal_projector.mm_input_projection_weight")
    text_hidden = int(projection[0].shape[-1])  # the text model's hidden size
    mm_tokens = int(_setting(hf_config, "mm_tokens_per_image", _MM_TOKENS))
    patches = vit.image_size // vit.patch_size
    tokens = int(round(mm_tokens ** 0.5))
    if tokens * tokens != mm_tokens or patches % tokens:
        raise ModelFormatError(f"Gemma 3: {mm_tokens} tokens per image do not pool from {patches} x {patches} patches")
    projector_cls, vision_cls = _classes()
    projector = projector_cls(vit.hidden_size, text_hidden, patches, tokens, vit.layer_norm_eps)
    model = vision_cls(vit, projector, Gemma3ImageProcessor(preprocessor, hf_config, tokenizer, vit.image_size))
    model.load(weights)
    return model.eval()
