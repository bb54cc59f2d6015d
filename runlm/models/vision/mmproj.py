"""llama.cpp's multimodal projector files (``mmproj`` GGUF, written by ``convert_hf_to_gguf.py --mmproj``) read
back as what a vision family builds from: the Hugging Face config, the image processor's config and the
checkpoint's vision and projector tensors under their transformers names.

An mmproj file has ``general.architecture`` "clip", the tower's shape in ``clip.vision.*`` metadata
(image_size, patch_size, embedding_length, feed_forward_length, block_count, attention.head_count,
attention.layer_norm_epsilon, image_mean / image_std, projector.scale_factor, preproc_image_size), the
projector's kind in ``clip.projector_type`` and its tensors under llama.cpp's names::

    v.patch_embd.{weight,bias}  v.position_embd.weight  v.class_embd  v.pre_ln.*  v.post_ln.*
    v.blk.N.{attn_q,attn_k,attn_v,attn_out,ln1,ln2,ffn_up,ffn_down}.{weight,bias}
    mm.model.fc.weight (idefics3)  mm.input_projection.weight, mm.soft_emb_norm.weight (gemma3)
    mm.0.*, mm.2.* (mlp: LLaVA-1.5's two-layer projector)  mm.1.*, mm.2.* (pixtral: Pixtral-12B)
    v.blk.N.ffn_gate, v.patch_embd.weight.1, mm.0.*, mm.2.* (qwen2.5vl_merger: Qwen2.5-VL)

What the converter changed is undone here (tools/mtmd/clip.cpp reads the files the same way):

* tensors are stored in the file's type (F32, F16 — the converter forces F16 on Gemma 3's input projection,
  and keeps ``.embeddings.`` tensors F32 — or a block type) and come back dequantized to float32;
* Gemma 3's ``mm.soft_emb_norm`` was stored as ``1 + w`` (llama.cpp's RMS norm multiplies by the weight;
  Gemma3RMSNorm by 1 + weight): 1 is taken off again;
* files written by older scripts name the tower's MLP the wrong way round (``ffn_down`` [hidden -> inner]);
  clip.cpp swaps them back when ``ffn_down`` takes the tower's width, and so does this;
* Pixtral's q/k rows were permuted for ggml's RoPE (LlamaModel.permute): un-permuted; Qwen2.5-VL's fused qkv
  was split in three and its two-frame patch convolution in two: put back together.

The file is untrusted input: every size the metadata gives is bounded before a tensor is shaped from it, every
tensor's shape is checked against the config before it is dequantized, and a file with tensors this reader
does not know is refused rather than half-read.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from runlm.formats import ModelFormatError

if TYPE_CHECKING:
    import torch

    from runlm.formats.gguf import GGUFFile

# Generous bounds on what a real tower has (SigLIP-so400m: 27 layers, width 1152, 4304 inner; images to ~1k pixels)
_MAX_IMAGE_SIZE = 8192
_MAX_WIDTH = 1 << 15
_MAX_LAYERS = 256
_MAX_HEADS = 1024
_MAX_SCALE = 64

_BLOCK = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")
_BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
                "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_TOWER_NAMES = {"v.patch_embd.weight": "embeddings.patch_embedding.weight",
                "v.patch_embd.bias": "embeddings.patch_embedding.bias",
                "v.position_embd.weight": "embeddings.position_embedding.weight",
                "v.class_embd": "embeddings.class_embedding",
                "v.pre_ln.weight": "pre_layrnorm.weight", "v.pre_ln.bias": "pre_layrnorm.bias",
                "v.post_ln.weight": "post_layernorm.weight", "v.post_ln.bias": "post_layernorm.bias"}


@dataclass(frozen=True, slots=True)
class ClipVision:
    """The tower's shape as the file's clip.vision.* metadata gives it, each value bounded."""
    image_size: int
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_norm_eps: float
    hidden_act: str
    projection_dim: int  # the text model's hidden size
    image_mean: list[float]
    image_std: list[float]

    def hf(self, model_type: str) -> dict[str, Any]:
        return {"model_type": model_type, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
                "image_size": self.image_size, "patch_size": self.patch_size, "num_channels": 3,
                "layer_norm_eps": self.layer_norm_eps, "hidden_act": self.hidden_act}


def _int(mmproj: GGUFFile, key: str, low: int, high: int, default: int | None = None) -> int:
    value = mmproj.metadata.get(key, default)
    if value is None:
        raise ModelFormatError(f"{mmproj.path}: an mmproj file needs {key}")
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ModelFormatError(f"{mmproj.path}: {key} = {value!r} is not a whole number in [{low}, {high}]")
    return value


def _float(mmproj: GGUFFile, key: str, default: float) -> float:
    value = mmproj.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < float(value) < 1:
        raise ModelFormatError(f"{mmproj.path}: {key} = {value!r} is not a small positive number")
    return float(f"{float(value):.7g}")  # stored as float32: 1e-6 comes back as 9.99999997e-07


def _triple(mmproj: GGUFFile, key: str, default: list[float]) -> list[float]:
    value = mmproj.metadata.get(key, default)
    if (not isinstance(value, list) or len(value) != 3
            or not all(isinstance(v, int | float) and not isinstance(v, bool) and -1e3 < v < 1e3 for v in value)):
        raise ModelFormatError(f"{mmproj.path}: {key} must be three numbers, not {value!r}")
    if key.endswith("std") and not all(v > 0 for v in value):
        raise ModelFormatError(f"{mmproj.path}: {key} must be positive")
    return [float(v) for v in value]


def _activation(mmproj: GGUFFile) -> str:
    """clip.cpp's FFN op: use_gelu -> ggml's gelu (the tanh approximation), use_silu -> silu, else quick-GELU."""
    gelu, silu = bool(mmproj.metadata.get("clip.use_gelu", False)), bool(mmproj.metadata.get("clip.use_silu", False))
    if gelu and silu:
        raise ModelFormatError(f"{mmproj.path}: both clip.use_gelu and clip.use_silu are set")
    return "gelu_pytorch_tanh" if gelu else "silu" if silu else "quick_gelu"


def clip_vision(mmproj: GGUFFile) -> ClipVision:
    """The file's tower metadata, checked (ModelFormatError names the first bad key)."""
    if mmproj.architecture != "clip":
        raise ModelFormatError(f"{mmproj.path}: not an mmproj file (general.architecture is "
                               f"{mmproj.architecture!r}, not 'clip')")
    if not mmproj.metadata.get("clip.has_vision_encoder", False):
        raise ModelFormatError(f"{mmproj.path}: this mmproj file has no vision encoder (audio only?)")
    p = "clip.vision."
    image = _int(mmproj, p + "image_size", 1, _MAX_IMAGE_SIZE)
    patch = _int(mmproj, p + "patch_size", 1, image)
    hidden = _int(mmproj, p + "embedding_length", 1, _MAX_WIDTH)
    heads = _int(mmproj, p + "attention.head_count", 1, _MAX_HEADS)
    if hidden % heads:
        raise ModelFormatError(f"{mmproj.path}: the tower's width {hidden} is not a multiple of its {heads} heads")
    return ClipVision(image_size=image, patch_size=patch, hidden_size=hidden,
                      intermediate_size=_int(mmproj, p + "feed_forward_length", 1, _MAX_WIDTH * 8),
                      num_hidden_layers=_int(mmproj, p + "block_count", 1, _MAX_LAYERS),
                      num_attention_heads=heads,
                      layer_norm_eps=_float(mmproj, p + "attention.layer_norm_epsilon", 1e-6),
                      hidden_act=_activation(mmproj),
                      projection_dim=_int(mmproj, p + "projection_dim", 0, _MAX_WIDTH, 0),
                      image_mean=_triple(mmproj, p + "image_mean", [0.5, 0.5, 0.5]),
                      image_std=_triple(mmproj, p + "image_std", [0.5, 0.5, 0.5]))


def _tower_shapes(v: ClipVision, clip: bool) -> dict[str, tuple[int, ...]]:
    """Every tower tensor's llama.cpp name -> its shape (numpy order, as runlm's GGUF reader gives it)."""
    h, i, p = v.hidden_size, v.intermediate_size, v.patch_size
    patches = (v.image_size // p) ** 2 + int(clip)
    shapes: dict[str, tuple[int, ...]] = {"v.patch_embd.weight": (h, 3, p, p), "v.patch_embd.bias": (h,),
                                          "v.position_embd.weight": (patches, h), "v.class_embd": (h,)}
    for ln in ("v.pre_ln", "v.post_ln"):
        shapes[f"{ln}.weight"] = shapes[f"{ln}.bias"] = (h,)
    for n in range(v.num_hidden_layers):
        b = f"v.blk.{n}"
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            shapes[f"{b}.{proj}.weight"], shapes[f"{b}.{proj}.bias"] = (h, h), (h,)
        for ln in ("ln1", "ln2"):
            shapes[f"{b}.{ln}.weight"] = shapes[f"{b}.{ln}.bias"] = (h,)
        shapes[f"{b}.ffn_up.weight"], shapes[f"{b}.ffn_up.bias"] = (i, h), (i,)
        shapes[f"{b}.ffn_down.weight"], shapes[f"{b}.ffn_down.bias"] = (h, i), (h,)
    return shapes


# Pixtral's tower: RMS norms without biases, a SwiGLU MLP, no position table (2-D RoPE), no patch bias
_PIXTRAL_BLOCK = {"attn_q": "attention.q_proj", "attn_k": "attention.k_proj", "attn_v": "attention.v_proj",
                  "attn_out": "attention.o_proj", "ln1": "attention_norm", "ln2": "ffn_norm",
                  "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
                  "ffn_down": "feed_forward.down_proj"}


def _pixtral_shapes(v: ClipVision) -> dict[str, tuple[int, ...]]:
    h, i, p = v.hidden_size, v.intermediate_size, v.patch_size
    shapes: dict[str, tuple[int, ...]] = {"v.patch_embd.weight": (h, 3, p, p), "v.pre_ln.weight": (h,)}
    for n in range(v.num_hidden_layers):
        b = f"v.blk.{n}"
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            shapes[f"{b}.{proj}.weight"] = (h, h)
        shapes[f"{b}.ln1.weight"] = shapes[f"{b}.ln2.weight"] = (h,)
        shapes[f"{b}.ffn_gate.weight"] = shapes[f"{b}.ffn_up.weight"] = (i, h)
        shapes[f"{b}.ffn_down.weight"] = (h, i)
    return shapes


def _pixtral_name(name: str) -> str | None:
    if name == "v.patch_embd.weight":
        return "vision_tower.patch_conv.weight"
    if name == "v.pre_ln.weight":
        return "vision_tower.ln_pre.weight"
    m = _BLOCK.fullmatch(name)
    if m is None or m.group(2) not in _PIXTRAL_BLOCK or m.group(3) != "weight":
        return None
    return f"vision_tower.transformer.layers.{m.group(1)}.{_PIXTRAL_BLOCK[m.group(2)]}.weight"


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute of Pixtral's q/k rows (rotate-half pairs made adjacent for
    ggml's RoPE): [heads, 2, d/2, ...] was stored as [heads, d/2, 2, ...]."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _swapped_ffn(mmproj: GGUFFile, v: ClipVision) -> bool:
    """Older scripts wrote the tower's fc1 as ffn_down and fc2 as ffn_up; clip.cpp tells them by ffn_down taking
    the tower's width (its ggml ne[0], our last dimension) and swaps them back."""
    info = mmproj.tensors.get("v.blk.0.ffn_down.weight")
    return (info is not None and len(info.shape) == 2 and info.shape[-1] == v.hidden_size
            and v.intermediate_size != v.hidden_size)


def _tower_name(name: str, prefix: str, swapped: bool) -> str | None:
    if name in _TOWER_NAMES:
        return f"{prefix}.{_TOWER_NAMES[name]}"
    m = _BLOCK.fullmatch(name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    part = m.group(2)
    if swapped and part in ("ffn_up", "ffn_down"):
        part = "ffn_down" if part == "ffn_up" else "ffn_up"
    return f"{prefix}.encoder.layers.{m.group(1)}.{_BLOCK_NAMES[part]}.{m.group(3)}"


@dataclass(frozen=True, slots=True)
class _Layout:
    """How one projector type's file maps to its family's checkpoint."""
    tower_prefix: str                       # the tower's module in the HF checkpoint
    clip: bool                              # CLIP's class token and pre-norm (else SigLIP)
    projector: dict[str, str]               # llama.cpp name -> HF name
    projector_shapes: dict[str, tuple[int, ...]]
    required: frozenset[str]                # llama.cpp names the family cannot do without


def _layout(kind: str, v: ClipVision, mmproj: GGUFFile) -> _Layout:
    h, t = v.hidden_size, v.projection_dim
    tower = ["v.patch_embd.weight", "v.position_embd.weight", "v.post_ln.weight", "v.post_ln.bias"]
    for n in range(v.num_hidden_layers):
        tower += [f"v.blk.{n}.{part}.{wb}" for part in _BLOCK_NAMES for wb in ("weight", "bias")]
    if kind == "idefics3":
        s = _int(mmproj, "clip.vision.projector.scale_factor", 1, _MAX_SCALE, 2)
        return _Layout("model.vision_model", False,
                       {"mm.model.fc.weight": "model.connector.modality_projection.proj.weight"},
                       {"mm.model.fc.weight": (t, h * s * s)},
                       frozenset([*tower, "v.patch_embd.bias", "mm.model.fc.weight"]))
    if kind == "gemma3":
        # transformers 5 saves Gemma 3's tower as vision_tower.* (the hub's files: vision_tower.vision_model.*)
        return _Layout("vision_tower", False,
                       {"mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
                        "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight"},
                       {"mm.input_projection.weight": (h, t), "mm.soft_emb_norm.weight": (h,)},
                       frozenset([*tower, "v.patch_embd.bias", "mm.input_projection.weight",
                                  "mm.soft_emb_norm.weight"]))
    if kind == "mlp":
        # LLaVA-1.5's files (tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py): the tower's layers up to
        # the feature layer (clip.vision.block_count counts those), mm.0 -> GELU -> mm.2 into the text model
        # (clip.vision.projection_dim is CLIP's own projection, not the text width)
        inner, out = mmproj.tensors.get("mm.0.weight"), mmproj.tensors.get("mm.2.weight")
        if inner is None or out is None or len(inner.shape) != 2 or len(out.shape) != 2:
            raise ModelFormatError(f"{mmproj.path}: an mlp projector needs 2-D mm.0.weight and mm.2.weight")
        width, t = inner.shape[0], out.shape[0]
        if not (1 <= width <= _MAX_WIDTH * 8 and 1 <= t <= _MAX_WIDTH):
            raise ModelFormatError(f"{mmproj.path}: mm.0.weight / mm.2.weight have implausible shapes")
        clip = "v.class_embd" in mmproj.tensors
        proj = {f"mm.{i}.{wb}": f"multi_modal_projector.linear_{1 if i == 0 else 2}.{wb}"
                for i in (0, 2) for wb in ("weight", "bias")}
        return _Layout("vision_tower", clip, proj,
                       {"mm.0.weight": (width, h), "mm.0.bias": (width,), "mm.2.weight": (t, width), "mm.2.bias": (t,)},
                       frozenset([*tower[:2], *tower[4:], "mm.0.weight", "mm.2.weight",
                                  *(["v.class_embd", "v.pre_ln.weight", "v.pre_ln.bias"] if clip else [])]))
    if kind == "pixtral":
        # Pixtral-12B (LlavaForConditionalGeneration with a Pixtral tower): mm.1 -> GELU -> mm.2. Mistral Small
        # 3.1's files add mm.input_norm and mm.patch_merger (Mistral3's projector): not read yet.
        head = h // v.num_attention_heads
        if head % 2:
            raise ModelFormatError(f"{mmproj.path}: Pixtral's RoPE needs an even head size, not {head}")
        if "mm.patch_merger.weight" in mmproj.tensors:
            raise ModelFormatError(f"{mmproj.path}: Mistral 3's pixtral projector (a patch merger) is not read yet")
        out = mmproj.tensors.get("mm.2.weight")
        if out is None or len(out.shape) != 2 or not 1 <= out.shape[0] <= _MAX_WIDTH:
            raise ModelFormatError(f"{mmproj.path}: a pixtral projector needs a 2-D mm.2.weight")
        t = out.shape[0]
        proj = {f"mm.{i}.{wb}": f"multi_modal_projector.linear_{i}.{wb}" for i in (1, 2) for wb in ("weight", "bias")}
        shapes = {"mm.1.weight": (t, h), "mm.1.bias": (t,), "mm.2.weight": (t, t), "mm.2.bias": (t,)}
        required = [*_pixtral_shapes(v), "mm.1.weight", "mm.2.weight"]
        return _Layout("vision_tower", False, proj, shapes, frozenset(required))
    raise ModelFormatError(f"{mmproj.path}: runlm does not read mmproj files of projector type {kind!r}")


def _configs(kind: str, v: ClipVision, mmproj: GGUFFile, layout: _Layout) -> tuple[dict, dict]:
    """(the HF config, the image processor's config) of a projector type, as the HF model ships them."""
    rescale = {"do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
               "image_mean": v.image_mean, "image_std": v.image_std}
    if kind == "idefics3":
        scale = _int(mmproj, "clip.vision.projector.scale_factor", 1, _MAX_SCALE, 2)
        longest = _int(mmproj, "clip.vision.preproc_image_size", v.image_size, _MAX_IMAGE_SIZE, 4 * v.image_size)
        return ({"model_type": "idefics3", "architectures": ["Idefics3ForConditionalGeneration"],
                 "scale_factor": scale, "vision_config": v.hf("idefics3_vision"),
                 "text_config": {"model_type": "llama", "hidden_size": v.projection_dim}},
                {"image_processor_type": "Idefics3ImageProcessor", "do_resize": True,
                 "size": {"longest_edge": longest}, "max_image_size": {"longest_edge": v.image_size},
                 "do_image_splitting": True, "resample": 1, **rescale})  # LANCZOS, as clip.cpp resizes
    if kind == "gemma3":
        merge = _int(mmproj, "clip.vision.projector.scale_factor", 1, _MAX_SCALE, 4)
        side = v.image_size // v.patch_size // merge
        if side < 1:
            raise ModelFormatError(f"{mmproj.path}: a scale factor of {merge} leaves no tokens per image")
        return ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                 "mm_tokens_per_image": side * side, "vision_config": v.hf("siglip_vision_model"),
                 "text_config": {"model_type": "gemma3_text", "hidden_size": v.projection_dim}},
                {"image_processor_type": "Gemma3ImageProcessor", "do_resize": True,
                 "size": {"height": v.image_size, "width": v.image_size}, "resample": 2,  # BILINEAR
                 "do_pan_and_scan": False, "image_seq_length": side * side, **rescale})
    if kind == "pixtral":
        heads = v.num_attention_heads
        vision = {**v.hf("pixtral"), "head_dim": v.hidden_size // heads,
                  # convert_hf_to_gguf.py writes use_gelu for Pixtral's "gelu" (erf); its RoPE base is not in the file
                  "hidden_act": {"gelu_pytorch_tanh": "gelu"}.get(v.hidden_act, v.hidden_act),
                  "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"}}
        vision.pop("layer_norm_eps")
        text_hidden = layout.projector_shapes["mm.2.weight"][0]
        return ({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "vision_config": vision,
                 "text_config": {"model_type": "mistral", "hidden_size": text_hidden},
                 "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
                 "projector_hidden_act": "gelu", "multimodal_projector_bias": "mm.1.bias" in mmproj.tensors},
                {"image_processor_type": "PixtralImageProcessor", "do_resize": True,
                 "size": {"longest_edge": v.image_size},
                 "patch_size": {"height": v.patch_size, "width": v.patch_size}, "resample": 3, **rescale})
    # mlp: LLaVA-1.5 (CLIPImageProcessor: shortest edge, center crop, as llava-hf ships it; clip.cpp pads to a
    # square and resizes instead). The file holds the layers up to the feature layer and no final norm: a tower
    # one layer deeper read at -2 is the same (the layer after it is never built).
    vision = {**v.hf("clip_vision_model" if layout.clip else "siglip_vision_model"),
              "num_hidden_layers": v.num_hidden_layers + 1}
    square = {"height": v.image_size, "width": v.image_size}
    patches = (v.image_size // v.patch_size) ** 2
    return ({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "vision_config": vision,
             "text_config": {"model_type": "llama", "hidden_size": layout.projector_shapes["mm.2.weight"][0]},
             "vision_feature_layer": -2,
             "vision_feature_select_strategy": "default" if layout.clip else "full",
             "projector_hidden_act": "gelu", "multimodal_projector_bias": "mm.0.bias" in mmproj.tensors,
             "image_seq_length": patches},
            {"image_processor_type": "CLIPImageProcessor" if layout.clip else "SiglipImageProcessor",
             "do_resize": True, "resample": 3,
             "size": {"shortest_edge": v.image_size} if layout.clip else square,
             "do_center_crop": layout.clip, "crop_size": square, **rescale})


def _weights(mmproj: GGUFFile, names: dict[str, str], kind: str, heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    for name, hf in names.items():
        tensor = mmproj.load(name)  # dequantized / upcast to float32
        if kind == "gemma3" and name == "mm.soft_emb_norm.weight":
            tensor = tensor - 1.0  # stored as 1 + w (llama.cpp's RMS norm takes the weight as is)
        if kind == "pixtral" and name.endswith((".attn_q.weight", ".attn_k.weight")):
            tensor = _unpermute(tensor, heads)
        yield hf, tensor


def as_hf(mmproj: GGUFFile, family: ModuleType | None = None) -> tuple[dict, dict, Iterator[tuple[str, torch.Tensor]]]:
    """(hf_config, preprocessor config, weights): an mmproj file as the family's ``build`` takes them. Every name
    and shape is checked before anything is read; the weights are float32 tensors, dequantized as iterated."""
    kind = mmproj.metadata.get("clip.projector_type")
    if not isinstance(kind, str):
        raise ModelFormatError(f"{mmproj.path}: an mmproj file needs clip.projector_type")
    if family is not None:
        from runlm.models.vision import FAMILIES

        short = family.__name__.rsplit(".", 1)[-1]
        kinds = FAMILIES[short][1] if short in FAMILIES else getattr(family, "PROJECTOR_TYPES", ())
        if kind not in kinds:
            raise ModelFormatError(f"{mmproj.path}: projector type {kind!r} is not the {short} family's")
    v = clip_vision(mmproj)
    if kind == "qwen2.5vl_merger":
        return _qwen_as_hf(mmproj, v)
    layout = _layout(kind, v, mmproj)
    pixtral = kind == "pixtral"
    shapes = {**(_pixtral_shapes(v) if pixtral else _tower_shapes(v, layout.clip)), **layout.projector_shapes}
    required = set(layout.required)
    swapped = not pixtral and _swapped_ffn(mmproj, v)
    names: dict[str, str] = {}
    for name, info in mmproj.tensors.items():
        if pixtral and name == "v.token_embd.img_break":
            continue  # [IMG_BREAK]'s embedding: runlm's prompt keeps the token, the text model embeds it
        hf = layout.projector.get(name) or (_pixtral_name(name) if pixtral else
                                            _tower_name(name, layout.tower_prefix, swapped))
        if hf is None:
            raise ModelFormatError(f"{mmproj.path}: tensor {name!r} is not one runlm reads in a {kind!r} mmproj "
                                   f"file")
        want = shapes.get(name)
        if swapped and want is not None and ".ffn_" in name:  # the shapes of the name it was written under
            other = name.replace("ffn_up", "ffn_tmp").replace("ffn_down", "ffn_up").replace("ffn_tmp", "ffn_down")
            want = shapes[other]
        if want is None or tuple(info.shape) != want:
            raise ModelFormatError(f"{mmproj.path}: tensor {name!r} has shape {tuple(info.shape)}, expected {want} "
                                   f"from the file's metadata")
        names[name] = hf
    missing = sorted(required - names.keys())
    if missing:
        raise ModelFormatError(f"{mmproj.path}: the mmproj file lacks {len(missing)} tensors, e.g. {missing[:3]}")
    hf_config, preprocessor = _configs(kind, v, mmproj, layout)
    return hf_config, preprocessor, _weights(mmproj, names, kind, v.num_attention_heads)


# ---- Qwen2.5-VL ------------------------------------------------------------------------------------------------
# convert_hf_to_gguf.py splits Qwen2.5-VL's fused qkv into attn_q/k/v and its Conv3d patch embedding (two frames)
# into v.patch_embd.weight and .weight.1: both are put back together here. The file holds no window size (clip.cpp
# uses 112 pixels, the size of every released model) nor the processor's pixel bounds (clip.cpp: 8 to 4096 merged
# tokens); this reads what clip.cpp computes with.
_QWEN_BLOCK = {"attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_q": "attn.qkv", "attn_k": "attn.qkv",
               "attn_v": "attn.qkv"}
_QWEN_WINDOW = 112


def _qwen_shapes(v: ClipVision, out: int) -> dict[str, tuple[int, ...]]:
    h, i, p = v.hidden_size, v.intermediate_size, v.patch_size
    merged = h * 4  # the merger's input: a 2 x 2 block of patches
    shapes: dict[str, tuple[int, ...]] = {"v.patch_embd.weight": (h, 3, p, p), "v.patch_embd.weight.1": (h, 3, p, p),
                                          "v.post_ln.weight": (h,), "mm.0.weight": (merged, merged),
                                          "mm.0.bias": (merged,), "mm.2.weight": (out, merged), "mm.2.bias": (out,)}
    for n in range(v.num_hidden_layers):
        b = f"v.blk.{n}"
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            shapes[f"{b}.{proj}.weight"], shapes[f"{b}.{proj}.bias"] = (h, h), (h,)
        shapes[f"{b}.ln1.weight"] = shapes[f"{b}.ln2.weight"] = (h,)
        for proj in ("ffn_gate", "ffn_up"):
            shapes[f"{b}.{proj}.weight"], shapes[f"{b}.{proj}.bias"] = (i, h), (i,)
        shapes[f"{b}.ffn_down.weight"], shapes[f"{b}.ffn_down.bias"] = (h, i), (h,)
    return shapes


def _qwen_name(name: str) -> str | None:
    fixed = {"v.patch_embd.weight": "visual.patch_embed.proj.weight",
             "v.patch_embd.weight.1": "visual.patch_embed.proj.weight", "v.post_ln.weight": "visual.merger.ln_q.weight",
             "mm.0.weight": "visual.merger.mlp.0.weight", "mm.0.bias": "visual.merger.mlp.0.bias",
             "mm.2.weight": "visual.merger.mlp.2.weight", "mm.2.bias": "visual.merger.mlp.2.bias"}
    if name in fixed:
        return fixed[name]
    m = _BLOCK.fullmatch(name)
    if m is None or m.group(2) not in _QWEN_BLOCK:
        return None
    return f"visual.blocks.{m.group(1)}.{_QWEN_BLOCK[m.group(2)]}.{m.group(3)}"


def _qwen_as_hf(mmproj: GGUFFile, v: ClipVision) -> tuple[dict, dict, Iterator[tuple[str, torch.Tensor]]]:
    out = mmproj.tensors.get("mm.2.weight")
    if out is None or len(out.shape) != 2 or not 1 <= out.shape[0] <= _MAX_WIDTH:
        raise ModelFormatError(f"{mmproj.path}: a Qwen2.5-VL projector needs a 2-D mm.2.weight")
    merge = _int(mmproj, "clip.vision.spatial_merge_size", 1, _MAX_SCALE, 2)
    if merge != 2:
        raise ModelFormatError(f"{mmproj.path}: a Qwen2.5-VL merger of {merge} x {merge} patches (runlm reads 2 x 2)")
    pattern = _int(mmproj, "clip.vision.n_wa_pattern", 1, _MAX_LAYERS)
    window = _int(mmproj, "clip.vision.window_size", 1, _MAX_IMAGE_SIZE, _QWEN_WINDOW)
    shapes = _qwen_shapes(v, out.shape[0])
    for name, info in mmproj.tensors.items():
        if _qwen_name(name) is None or shapes.get(name) != tuple(info.shape):
            raise ModelFormatError(f"{mmproj.path}: tensor {name!r} of shape {tuple(info.shape)} is not one runlm "
                                   f"reads in a Qwen2.5-VL mmproj file (expected {shapes.get(name)})")
    missing = sorted(shapes.keys() - mmproj.tensors.keys())
    if missing:
        raise ModelFormatError(f"{mmproj.path}: the mmproj file lacks {len(missing)} tensors, e.g. {missing[:3]}")
    area = (v.patch_size * merge) ** 2
    hf_config = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                 "vision_config": {"model_type": "qwen2_5_vl_vision", "depth": v.num_hidden_layers,
                                   "hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
                                   "num_heads": v.num_attention_heads, "patch_size": v.patch_size,
                                   "spatial_merge_size": merge, "temporal_patch_size": 2, "window_size": window,
                                   "fullatt_block_indexes": list(range(pattern - 1, v.num_hidden_layers, pattern)),
                                   "out_hidden_size": out.shape[0], "hidden_act": v.hidden_act, "in_channels": 3},
                 "text_config": {"model_type": "qwen2", "hidden_size": out.shape[0]}}
    preprocessor = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "resample": 3,
                    "size": {"shortest_edge": 8 * area, "longest_edge": 4096 * area}, "patch_size": v.patch_size,
                    "merge_size": merge, "temporal_patch_size": 2, "do_rescale": True, "rescale_factor": 1 / 255,
                    "do_normalize": True, "do_convert_rgb": True, "image_mean": v.image_mean, "image_std": v.image_std}

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        import torch

        yield "visual.patch_embed.proj.weight", torch.stack([mmproj.load("v.patch_embd.weight"),
                                                              mmproj.load("v.patch_embd.weight.1")], dim=2)
        for name in shapes:
            hf = _qwen_name(name)
            assert hf is not None
            if name.startswith("v.patch_embd"):
                continue
            m = _BLOCK.fullmatch(name)
            if m is not None and m.group(2) in ("attn_k", "attn_v"):
                continue  # with attn_q
            if m is not None and m.group(2) == "attn_q":
                b, wb = f"v.blk.{m.group(1)}", m.group(3)
                yield hf, torch.cat([mmproj.load(f"{b}.attn_{x}.{wb}") for x in "qkv"])
            else:
                yield hf, mmproj.load(name)

    return hf_config, preprocessor, weights()


# ---- finding the projector beside a model file ------------------------------------------------------------

def _mmproj_header(path: Path) -> GGUFFile | None:
    """The header of ``path`` where it is an mmproj GGUF (general.architecture "clip"), else None; never raises."""
    from runlm.formats.gguf import GGUFFile

    try:
        gguf = GGUFFile(path) if path.is_file() else None
    except (OSError, ValueError, OverflowError):  # ModelFormatError is a ValueError
        return None
    return gguf if gguf is not None and gguf.architecture == "clip" else None


def is_mmproj(path: Path) -> bool:
    """Whether ``path`` is an mmproj GGUF (its header says general.architecture "clip"); never raises."""
    return _mmproj_header(path) is not None


def find_projector(model: Path) -> GGUFFile | None:
    """The projector that goes with a text GGUF, its header read once: ``model`` itself a directory or a .gguf
    file, the one mmproj GGUF beside it (``mmproj*.gguf``, ``*mmproj*.gguf``, or the store's ``model.mmproj``),
    else None. Two candidates are ambiguous: none is chosen (pass --mmproj)."""
    folder = model if model.is_dir() else model.parent
    if not folder.is_dir():
        return None
    named = sorted({*folder.glob("*mmproj*.gguf"), *folder.glob("*.mmproj")})
    found = [h for h in (_mmproj_header(p) for p in named if p != model) if h is not None]
    return found[0] if len(found) == 1 else None


def find_mmproj(model: Path) -> Path | None:
    """The path of find_projector's file."""
    found = find_projector(model)
    return None if found is None else found.path
