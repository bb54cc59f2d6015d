"""From a path on disk to a ready model: which kind it is, its config, weights and tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from runlm import kernels
from runlm.formats import ModelFormatError
from runlm.formats.gguf import GGUFFile
from runlm.formats.tokenizer import Tokenizer
from runlm.models.config import ModelConfig
from runlm.models.llama import LlamaForCausalLM
from runlm.models.weights import gguf_weights, read_hf_config, rope_freq_factors, safetensors_weights
from runlm.models.pooling import has_sentence_transformers_pooling

_ENCODER_GGUF_ARCHS = {"bert", "nomic-bert", "jina-bert-v2"}
_ENCODER_HF_ARCHS = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "XLMRobertaModel",
                     "RobertaModel", "NomicBertModel")
_DECODER_BODY_ARCHS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")


class NotAGeneratorError(ModelFormatError):
    """The model embeds or scores text; it cannot generate."""


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path


def model_task(path: Path) -> str:
    """'generate', 'embed' or 'score', from the file's own metadata (no weights read)."""
    if path.is_file():
        return "embed" if GGUFFile(path).architecture in _ENCODER_GGUF_ARCHS else "generate"
    cfg = read_hf_config(path)
    archs = cfg.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in archs) or cfg.get("classifier_from_token"):
        return "score"
    is_encoder = any(a in _ENCODER_HF_ARCHS for a in archs) or cfg.get("model_type") in ("bert", "roberta")
    # a bare decoder body (Qwen3Model) or one shipped with a sentence-transformers pooler embeds
    is_embedder = any(a in _DECODER_BODY_ARCHS for a in archs) or has_sentence_transformers_pooling(path)
    return "embed" if is_encoder or is_embedder else "generate"


def _empty_model(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> LlamaForCausalLM:
    """Allocate without random init: every parameter is overwritten by load_weights."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, freq_factors)
    return model.to_empty(device="cpu")


def load_decoder(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedModel:
    """Build a Llama-family decoder from a .gguf file or a safetensors directory."""
    path = Path(path)
    if model_task(path) != "generate":
        raise NotAGeneratorError(f"{path}: this is an embedding model (or a reranker); it cannot "
                                 f"generate text (use it for embeddings or scores instead)")
    if path.is_file():
        gguf = GGUFFile(path)
        gguf.check_architecture()
        cfg = ModelConfig.from_gguf(gguf)
        tokenizer = Tokenizer.from_gguf(gguf)
        model = _empty_model(cfg, rope_freq_factors(gguf))
        # int8 block weights where the fp32 CPU kernels run; elsewhere everything is dequantized
        keep_quantized = torch.device(device).type == "cpu" and dtype == torch.float32 and kernels.available()
        weights = gguf_weights(gguf, cfg, keep_quantized)
    else:
        cfg = ModelConfig.from_hf(read_hf_config(path), source=str(path / "config.json"))
        tokenizer = Tokenizer.from_dir(path)
        model = _empty_model(cfg)
        weights = safetensors_weights(path)
    try:
        model.load_weights(weights)
    except (KeyError, RuntimeError) as exc:
        raise ModelFormatError(f"{path}: weights do not fit the {cfg.family} config: {exc}") from None
    if not cfg.eos_token_ids and tokenizer.eos_token_id is not None:
        cfg.eos_token_ids = [tokenizer.eos_token_id]
    model = model.to(device=device, dtype=dtype).eval()
    return LoadedModel(model, cfg, tokenizer, path)
