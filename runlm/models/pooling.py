"""Pooling: one vector per sequence from a batch of flattened hidden states.

How a model pools is read from its own sentence-transformers files where present
(modules.json -> the Pooling module's config.json, a Normalize module, sentence_bert_config.json's
max_seq_length), otherwise vLLM's defaults: CLS for BERT encoders, last token for decoders, both
normalised.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from runlm.formats import ModelFormatError

POOLING_MODES = ("mean", "cls", "last")
# sentence-transformers' Pooling config key -> our mode
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(slots=True)
class PoolerConfig:
    mode: str = "cls"
    normalize: bool = True
    max_seq_length: int | None = None  # sentence-transformers' limit, below the position table's
    matryoshka: bool = False           # may the embedding be truncated to fewer dimensions?

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {', '.join(POOLING_MODES)}, not {self.mode!r}")


def _read(path: Path) -> dict | list | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path}: cannot read JSON: {exc}") from None


def has_sentence_transformers_pooling(directory: Path) -> bool:
    modules = _read(directory / "modules.json")
    return isinstance(modules, list) and any(str(m.get("type", "")).endswith(".Pooling") for m in modules
                                             if isinstance(m, dict))


def read_pooler_config(directory: Path | None, default_mode: str, hf_config: dict) -> PoolerConfig:
    """The model's own pooling recipe; ``default_mode`` where it has no sentence-transformers files."""
    cfg = PoolerConfig(default_mode, True)
    dims = hf_config.get("matryoshka_dimensions")
    cfg.matryoshka = bool(hf_config.get("is_matryoshka") or dims)
    if directory is None or not directory.is_dir():
        return cfg
    modules = _read(directory / "modules.json")
    if not isinstance(modules, list):
        return cfg
    cfg.normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules if isinstance(m, dict))
    for m in modules:
        if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling"):
            pooling_file = directory / str(m.get("path", "")) / "config.json"
            pooling = _read(pooling_file) or {}
            if not isinstance(pooling, dict):
                raise ModelFormatError(f"{pooling_file}: not a JSON object")
            if any(pooling.get(k) for k in _ST_UNSUPPORTED):
                raise ModelFormatError(f"{directory}: pooling mode {pooling} is not supported "
                                       f"(runlm pools by mean, CLS or last token)")
            if isinstance(pooling.get("pooling_mode"), str):  # newer sentence-transformers spelling
                mode = {"lasttoken": "last", "cls": "cls", "mean": "mean"}.get(pooling["pooling_mode"])
            else:
                mode = next((v for k, v in _ST_MODES.items() if pooling.get(k)), None)
            if mode is None:
                raise ModelFormatError(f"{directory}: unsupported sentence-transformers pooling {pooling}")
            cfg.mode = mode
    st = _read(directory / "sentence_bert_config.json")
    if isinstance(st, dict) and isinstance(st.get("max_seq_length"), int):
        cfg.max_seq_length = st["max_seq_length"]
    return cfg


def pool(hidden: torch.Tensor, query_lens: list[int], mode: str) -> torch.Tensor:
    """hidden [T, H] holds the sequences back to back; returns [len(query_lens), H] in float32."""
    lens = torch.tensor(query_lens, device=hidden.device)
    ends = torch.cumsum(lens, 0)
    if mode == "cls":
        out = hidden[ends - lens]
    elif mode == "last":
        out = hidden[ends - 1]
    else:
        out = torch.stack([chunk.float().mean(0) for chunk in hidden.split(query_lens)])
    return out.float()


def finish_embedding(vec: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Matryoshka truncation first, then normalisation (as vLLM and OpenAI's shortened embeddings)."""
    if dimensions is not None:
        vec = vec[..., :dimensions]
    return F.normalize(vec, p=2, dim=-1) if normalize else vec
