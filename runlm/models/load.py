"""From a model's spec (runlm.models.spec) to a torch model: its weights, on the torch runner's terms."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runlm.formats import ModelFormatError
from runlm.formats.tokenizer import Tokenizer
from runlm.models import families
from runlm.models.config import ModelConfig
from runlm.models.spec import ModelSpec, as_spec

if TYPE_CHECKING:  # the model classes and weight readers are torch's: imported by what builds a model
    import torch

    from runlm.models.linear import Weight
    from runlm.models.llama import LlamaForCausalLM
    from runlm.models.offload import LayerSplit
    from runlm.models.vision import VisionModel


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    vision: VisionModel | None = None  # a vision-language model's tower and projector (runlm.models.vision)
    offload: LayerSplit | None = None  # the GPU runner's layer offload: layers on the CPU (runlm.models.offload)


def _empty_model(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> LlamaForCausalLM:
    """No storage and no random init: load_weights materializes each parameter it fills (and a layer
    served from GGUF blocks never gets an fp32 weight)."""
    import torch

    with torch.device("meta"):
        cls: type[LlamaForCausalLM] = families.get(cfg.family).torch_class()  # (a subclass, configured by cfg)
        return cls(cfg, freq_factors)


def gguf_weight_mode(dtype: torch.dtype, device: str, exact_numerics: bool) -> str:
    """How matrices are held (see models.weights): as stored ("ggml", the fast default on CPU: GGUF
    blocks, or bf16/fp16 safetensors), as int8 blocks dequantized in registers ("int8", exact
    numerics, GGUF), or fp32."""
    import torch

    from runlm import kernels
    from runlm.kernels import ggml

    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return "dense"
    if not exact_numerics and ggml.available():
        return "ggml"
    return "int8" if kernels.available() else "dense"


def split_vision(weights: Iterable[tuple[str, Weight]], text_weight: Callable[[str], str | None],
                  vision: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Weight]]:
    """A vision-language checkpoint's text weights under the text decoder's names; the rest go to ``vision``."""
    from runlm.models.linear import BlockQuantized, GGMLWeight

    for name, tensor in weights:
        text = text_weight(name)
        if text is not None:
            yield text, tensor
        else:
            vision.append((name, tensor.dense() if isinstance(tensor, GGMLWeight) else
                           tensor.dense if isinstance(tensor, BlockQuantized) else tensor))


def load_decoder(model: ModelSpec | str | Path, dtype: torch.dtype | str = "float32", device: str = "cpu",
                 exact_numerics: bool = False, mmproj: str | Path | None = None) -> LoadedModel:
    """Build a Llama-family decoder from a .gguf file or a safetensors directory (a ModelSpec, or its path) with
    its vision tower, for a vision-language model: from the directory, or from llama.cpp's ``mmproj`` file beside
    a GGUF (the spec's projector; with a path, the ``mmproj`` named).

    exact_numerics keeps reference numerics (dequantized weights times fp32 activations, the mode
    parity tests against transformers use); the default computes on GGUF blocks as stored with
    8-bit activations, llama.cpp's numerics. ``dtype``: a torch.dtype or its name."""
    import torch

    from runlm import kernels
    from runlm.dtypes import torch_dtype
    from runlm.kernels import fused
    from runlm.models import vision as vlm
    from runlm.models.weights import (
        gguf_qk_rows_turned,
        gguf_rope_interleaved,
        gguf_weights,
        hf_renamed,
        rope_freq_factors,
        safetensors_weights,
    )

    spec = as_spec(model, mmproj)
    dtype, path = torch_dtype(dtype), spec.path
    cfg = spec.decoder_config()
    tokenizer = spec.tokenizer()
    vision_weights: list[tuple[str, torch.Tensor]] = []
    family = vlm.family_module(spec.vision) if spec.vision is not None and spec.projector is None else None
    if spec.gguf is not None:
        gguf = spec.gguf
        model_ = _empty_model(cfg, rope_freq_factors(gguf))
        mode = gguf_weight_mode(dtype, device, exact_numerics)
        permuted = gguf_rope_interleaved(gguf.architecture)
        turned = gguf_qk_rows_turned(gguf.architecture, cfg, mode)  # (its Q/K rows loaded as halves)
        if permuted and not turned or not permuted and families.get(cfg.family).hf_rope_interleaved:
            model_.model.rope.use_interleaved_pairs()
        weights = gguf_weights(gguf, cfg, mode)
    else:
        model_ = _empty_model(cfg)
        if families.get(cfg.family).hf_rope_interleaved:  # the checkpoint's Q/K rows are in that layout
            model_.model.rope.use_interleaved_pairs()
        mode = "ggml" if gguf_weight_mode(dtype, device, exact_numerics) == "ggml" else "dense"
        weights = safetensors_weights(spec.safetensors(), mode, spec.hf_config)  # (config.json read once)
        if family is not None:
            weights = split_vision(weights, family.text_weight, vision_weights)
        weights = hf_renamed(weights, cfg.family)
    try:
        model_.load_weights(weights)
    except (KeyError, RuntimeError) as exc:
        raise ModelFormatError(f"{path}: weights do not fit the {cfg.family} config: {exc}") from None
    model_ = model_.to(device=device, dtype=dtype).eval()
    vision = None
    if family is not None:
        assert spec.hf_config is not None
        vision = vlm.build_hf(path, spec.hf_config, vision_weights, tokenizer)
    elif spec.projector is not None:
        vision = vlm.build_mmproj(spec.projector, tokenizer)
    # fast mode runs each layer's small ops fused (exact mode keeps torch's, the reference numerics)
    model_.model.fused = (model_.model.supports_fused and not exact_numerics and torch.device(device).type == "cpu"
                          and dtype == torch.float32 and fused.available() and kernels.attention_available())
    if vision is not None:
        vision = vision.to(device=device)  # the tower computes in float32: its numerics are transformers'
    return LoadedModel(model_, cfg, tokenizer, path, vision)
