"""From a path on disk to a ready model: which kind it is, its config, weights and tokenizer."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runlm.formats import ModelFormatError
from runlm.formats.architectures import ENCODER_GGUF_ARCHS, ENCODER_HF_ARCHS
from runlm.formats.gguf import GGUFFile
from runlm.formats.safetensors import read_hf_config
from runlm.formats.tokenizer import Tokenizer
from runlm.models import families
from runlm.models.config import ModelConfig

if TYPE_CHECKING:  # the model classes and weight readers are torch's: imported by what builds a model
    import torch

    from runlm.models.linear import Weight
    from runlm.models.llama import LlamaForCausalLM
    from runlm.models.vision import VisionModel

_DECODER_BODY_ARCHS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")


class NotAGeneratorError(ModelFormatError):
    """The model embeds or scores text; it cannot generate."""


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    vision: VisionModel | None = None  # a vision-language model's tower and projector (runlm.models.vision)


def model_task(path: Path) -> str:
    """'generate', 'embed' or 'score', from the file's own metadata (no weights read)."""
    if path.is_file():
        return _gguf_task(GGUFFile(path))
    return _hf_task(read_hf_config(path), path)


def _gguf_task(gguf: GGUFFile) -> str:
    return "embed" if gguf.architecture in ENCODER_GGUF_ARCHS else "generate"


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


def _split_vision(weights: Iterable[tuple[str, Weight]], text_weight: Callable[[str], str | None],
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


def load_decoder(path: str | Path, dtype: torch.dtype | str = "float32", device: str = "cpu",
                 exact_numerics: bool = False, mmproj: str | Path | None = None) -> LoadedModel:
    """Build a Llama-family decoder from a .gguf file or a safetensors directory (with its vision tower, for a
    vision-language model: from the directory, or from llama.cpp's ``mmproj`` file beside a GGUF).

    exact_numerics keeps reference numerics (dequantized weights times fp32 activations, the mode
    parity tests against transformers use); the default computes on GGUF blocks as stored with
    8-bit activations, llama.cpp's numerics. ``dtype``: a torch.dtype or its name."""
    import torch

    from runlm import kernels
    from runlm.dtypes import torch_dtype
    from runlm.kernels import fused
    from runlm.models import vision as vlm
    from runlm.models.weights import (
        gguf_rope_interleaved,
        gguf_weights,
        rope_freq_factors,
        safetensors_weights,
    )

    dtype = torch_dtype(dtype)
    path = Path(path)
    vision_weights: list[tuple[str, torch.Tensor]] = []
    family = None
    not_a_generator = NotAGeneratorError(f"{path}: this is an embedding model (or a reranker); it cannot "
                                         f"generate text (use it for embeddings or scores instead)")
    if path.is_file():
        gguf = GGUFFile(path)
        if _gguf_task(gguf) != "generate":
            raise not_a_generator
        gguf.check_architecture()
        cfg = ModelConfig.from_gguf(gguf)
        tokenizer = Tokenizer.from_gguf(gguf)
        model = _empty_model(cfg, rope_freq_factors(gguf))
        mode = gguf_weight_mode(dtype, device, exact_numerics)
        if mode == "ggml" and gguf_rope_interleaved(gguf.architecture):
            model.model.rope.use_interleaved_pairs()
        weights = gguf_weights(gguf, cfg, mode)
    else:
        hf_config = read_hf_config(path)
        family = vlm.hf_family(hf_config)
        if family is None and _hf_task(hf_config, path) != "generate":
            raise not_a_generator
        text_config = family.text_config(hf_config) if family is not None else hf_config
        cfg = ModelConfig.from_hf(text_config, source=str(path / "config.json"))
        tokenizer = Tokenizer.from_dir(path)
        model = _empty_model(cfg)
        weights = safetensors_weights(path, "ggml" if gguf_weight_mode(dtype, device, exact_numerics) == "ggml"
                                      else "dense")
        if family is not None:
            weights = _split_vision(weights, family.text_weight, vision_weights)
    try:
        model.load_weights(weights)
    except (KeyError, RuntimeError) as exc:
        raise ModelFormatError(f"{path}: weights do not fit the {cfg.family} config: {exc}") from None
    if not cfg.eos_token_ids and tokenizer.eos_token_id is not None:
        cfg.eos_token_ids = [tokenizer.eos_token_id]
    model = model.to(device=device, dtype=dtype).eval()
    vision = None
    if family is not None:
        vision = vlm.build_hf(path, hf_config, vision_weights, tokenizer)
    elif mmproj is not None:
        vision = vlm.build_mmproj(GGUFFile(Path(mmproj)), tokenizer)
    # fast mode runs each layer's small ops fused (exact mode keeps torch's, the reference numerics)
    model.model.fused = (model.model.supports_fused and not exact_numerics and torch.device(device).type == "cpu"
                         and dtype == torch.float32 and fused.available() and kernels.attention_available())
    if vision is not None:
        vision = vision.to(device=device)  # the tower computes in float32: its numerics are transformers'
    return LoadedModel(model, cfg, tokenizer, path, vision)
