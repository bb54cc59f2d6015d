"""Pooling models from a safetensors directory: BERT encoders and Llama-family decoders that embed
(last-token pooling, Qwen3-Embedding style) or score (``*ForSequenceClassification``: a linear
``score`` head on the last token, as transformers' decoder rerankers)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from runlm.dtypes import torch_dtype
from runlm.formats import ModelFormatError
from runlm.formats.tokenizer import Tokenizer
from runlm.models.bert import BertConfig, BertModel
from runlm.models.config import ModelConfig
from runlm.models.llama import LlamaForCausalLM
from runlm.models.pooling import PoolerConfig, pool, read_pooler_config
from runlm.models.spec import ModelSpec, as_spec
from runlm.models.weights import safetensors_weights

_ACTIVATIONS = ("sigmoid", "identity", "softmax")


class DecoderPoolingModel(nn.Module):
    """A Llama-family decoder body with a pooler: forward -> hidden [T, H]; pooled -> [B, H] or [B, labels]."""
    causal = True

    def __init__(self, cfg: ModelConfig, pooling_mode: str, num_labels: int) -> None:
        super().__init__()
        # the body only: no lm_head (tied means "none of its own"), logits are never computed
        self.decoder = LlamaForCausalLM(replace(cfg, tie_word_embeddings=True))
        self.pooling_mode = pooling_mode
        self.score = nn.Linear(cfg.hidden_size, num_labels, bias=False) if num_labels else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.decoder(input_ids, positions)

    def pooled(self, hidden: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        vec = pool(hidden, query_lens, self.pooling_mode)
        return vec if self.score is None else self.score(vec.to(hidden.dtype)).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def body() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == "score.weight" and self.score is not None:
                    self.score.weight.copy_(tensor)
                    scored.append(name)
                elif name != "lm_head.weight":  # an embedder saved as a causal LM carries an unused head
                    yield (name if name.startswith("model.") else f"model.{name}"), tensor
        scored: list[str] = []
        self.decoder.load_weights(body())
        if self.score is not None and not scored:
            raise KeyError("checkpoint lacks the classifier weight 'score.weight'")


@dataclass(slots=True)
class LoadedPoolingModel:
    model: BertModel | DecoderPoolingModel
    tokenizer: Tokenizer
    task: str                 # "embed" or "score"
    pooler: PoolerConfig
    max_model_len: int
    vocab_size: int
    hidden_size: int
    num_labels: int           # 0 for embedders
    activation: str           # for classifier outputs: sigmoid | softmax | identity
    path: Path

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        if self.task == "embed":
            return ("embed",)
        return ("classify", "score") if self.num_labels == 1 else ("classify",)


def _activation(cfg: dict, num_labels: int) -> str:
    """sentence-transformers' CrossEncoder rule: its configured activation, else sigmoid for one label."""
    configured = str((cfg.get("sentence_transformers") or {}).get("activation_fn", "")).rsplit(".", 1)[-1].lower()
    if configured in _ACTIVATIONS:
        return configured
    return "sigmoid" if num_labels == 1 else "softmax"


def load_pooling_model(source: ModelSpec | str | Path, task: str = "auto", dtype: torch.dtype | str = torch.float32,
                       device: str = "cpu") -> LoadedPoolingModel:
    """An encoder or decoder that embeds (task 'embed') or scores (a sequence classifier): a ModelSpec or its
    path."""
    dtype = torch_dtype(dtype)
    spec = as_spec(source)
    path, hf = spec.path, spec.hf_config
    if hf is None:
        raise ModelFormatError(f"{path}: embedding and reranking models load from a safetensors directory "
                               f"(config.json + *.safetensors); GGUF encoders are not supported yet")
    source = str(path / "config.json")
    archs = hf.get("architectures") or []
    from_tokens = hf.get("classifier_from_token")  # a causal LM scored by its "yes"/"no" logits (vLLM's key)
    classifier = any(a.endswith("ForSequenceClassification") for a in archs) or bool(from_tokens)
    if task == "auto":
        task = "score" if classifier else "embed"
    if task == "score" and not classifier:
        kind = ", ".join(archs) or "no architectures"
        raise ModelFormatError(f"{path}: this model has no classification head ({kind}); it can embed but "
                               f"not score pairs")
    is_bert = hf.get("model_type") == "bert"
    pooler = read_pooler_config(path, "cls" if is_bert else "last", hf)
    if is_bert:
        cfg = BertConfig.from_hf(hf, source)
        if task == "embed":
            cfg = replace(cfg, num_labels=0)
        model: BertModel | DecoderPoolingModel = BertModel(cfg, pooler.mode)
        num_labels, hidden, vocab = cfg.num_labels, cfg.hidden_size, cfg.vocab_size
        max_len = cfg.max_position_embeddings
    else:
        dcfg = ModelConfig.from_hf(hf, source)
        num_labels = (len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2))) if task == "score" else 0
        num_labels = 1 if from_tokens and task == "score" else num_labels
        with torch.device("meta"):  # no random init: load_weights fills every parameter
            model = DecoderPoolingModel(dcfg, pooler.mode, num_labels)
        model = model.to_empty(device="cpu")
        hidden, vocab, max_len = dcfg.hidden_size, dcfg.vocab_size, dcfg.max_position_embeddings
    tokenizer = spec.tokenizer()
    weights = safetensors_weights(spec.safetensors(), hf_config=spec.hf_config)
    if from_tokens and task == "score" and not is_bert:
        weights = _score_from_token_logits(weights, _token_ids(tokenizer, from_tokens, source),
                                           bool(hf.get("tie_word_embeddings", False)))
    try:
        model.load_weights(weights)
    except (KeyError, RuntimeError) as exc:
        raise ModelFormatError(f"{path}: weights do not fit the config: {exc}") from None
    if pooler.max_seq_length is not None:
        max_len = min(max_len, pooler.max_seq_length)
    model = model.to(device=device, dtype=dtype).eval()
    return LoadedPoolingModel(model, tokenizer, task, pooler, max_len, vocab, hidden,
                              num_labels, _activation(hf, num_labels), path)


def _token_ids(tokenizer: Tokenizer, tokens: object, source: str) -> list[int]:
    found = [tokenizer.hf.token_to_id(t) for t in tokens] if isinstance(tokens, list) else []
    ids = [i for i in found if i is not None]
    if len(ids) not in (1, 2) or len(ids) != len(found):
        raise ModelFormatError(f"{source}: classifier_from_token must name one or two tokens of the vocabulary "
                               f"(such as [\"no\", \"yes\"]), not {tokens!r}")
    return ids


def _score_from_token_logits(weights: Iterable[tuple[str, torch.Tensor]], ids: list[int],
                             tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """A one-label head from LM-head rows: logit(yes) - logit(no), whose sigmoid is P(yes) of the two."""
    head = "embed_tokens.weight" if tied else "lm_head.weight"
    for name, tensor in weights:
        if name.removeprefix("model.") == head:
            rows = tensor[ids]
            yield "score.weight", (rows[-1] - rows[0] if len(ids) == 2 else rows[0])[None]
        yield name, tensor
