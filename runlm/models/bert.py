"""BERT encoders: BertModel (sentence embeddings) and BertForSequenceClassification (cross-encoders).

The batch arrives flattened like the decoder's ([T] tokens, sequences back to back, lengths in the
forward context); every linear layer runs on the flat batch and only attention pads it, in groups
of similar length with a key mask, because BERT attends both ways within each sequence. Q/K/V are fused
into one matmul as in the decoder; parameter names otherwise follow Hugging Face's.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runlm.formats import ModelFormatError
from runlm.models.attention import AttentionBackend, get_forward_context
from runlm.models.pooling import pool

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


@dataclass(slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    num_labels: int = 0  # 0: an embedder; otherwise a sequence classifier with this many outputs

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], source: str = "config.json") -> BertConfig:
        if cfg.get("model_type") != "bert":
            raise ModelFormatError(f"{source}: model_type {cfg.get('model_type')!r} is not a supported encoder "
                                   f"(runlm runs BERT encoders)")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ModelFormatError(f"{source}: position_embedding_type {cfg['position_embedding_type']!r} "
                                   f"is not supported (only absolute)")
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ModelFormatError(f"{source}: hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        classifier = any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])
        labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
        return cls(int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]),
                   int(cfg["num_attention_heads"]), int(cfg["intermediate_size"]),
                   int(cfg.get("max_position_embeddings", 512)), int(cfg.get("type_vocab_size", 2)),
                   float(cfg.get("layer_norm_eps", 1e-12)), act, labels if classifier else 0)


class _Groups:
    """The batch cut into groups of similar length, each padded to [B_g, L_g] for one attention call.

    Padding every sequence to the batch's longest would make one long prompt cost a short one
    hundreds of wasted query rows; sorting by length and cutting where padding would exceed about a
    quarter of the real tokens keeps the waste small with few calls. Padding rows repeat a real
    token (masked out as keys, dropped as queries), so gathering needs no zero row.
    """

    def __init__(self, query_lens: list[int], device: torch.device) -> None:
        starts = [0]
        for n in query_lens[:-1]:
            starts.append(starts[-1] + n)
        order = sorted(range(len(query_lens)), key=query_lens.__getitem__)
        self.groups: list[tuple[torch.Tensor, torch.Tensor | None, int, int]] = []  # gather, mask, B, L
        inverse = [0] * (starts[-1] + query_lens[-1])  # flat token -> row of the groups' outputs, stacked
        members: list[int] = []
        rows = real = 0
        for i in order + [-1]:
            # sorted ascending, so the newcomer is the longest: would the group's padding grow too much?
            if members and (i < 0 or (len(members) + 1) * query_lens[i] > 1.25 * (real + query_lens[i]) + 32):
                rows = self._add(members, query_lens, starts, inverse, rows, device)
                members, real = [], 0
            members.append(i)
            real += query_lens[i]
        self.inverse = torch.tensor(inverse, device=device)

    def _add(self, members: list[int], lens: list[int], starts: list[int], inverse: list[int], rows: int,
             device: torch.device) -> int:
        width = max(lens[m] for m in members)
        gather: list[int] = []
        for row, m in enumerate(members):
            gather += range(starts[m], starts[m] + lens[m])
            gather += [starts[m]] * (width - lens[m])
            inverse[starts[m]:starts[m] + lens[m]] = range(rows + row * width, rows + row * width + lens[m])
        mask = None
        if any(lens[m] != width for m in members):
            key_lens = torch.tensor([lens[m] for m in members], device=device)
            mask = (torch.arange(width, device=device)[None, :] < key_lens[:, None])[:, None, None, :]
        self.groups.append((torch.tensor(gather, device=device), mask, len(members), width))
        return rows + len(members) * width

    def attend(self, qkv: torch.Tensor, heads: int, head_dim: int, scale: float) -> torch.Tensor:
        """qkv [T, 3 * H * D] -> attention output [T, H * D], each sequence attending only to itself."""
        outs = []
        for gather, mask, batch, width in self.groups:
            g = qkv.index_select(0, gather).view(batch, width, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(g[0], g[1], g[2], attn_mask=mask, scale=scale)  # [B, H, L, D]
            outs.append(o.transpose(1, 2).reshape(batch * width, heads * head_dim))
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).index_select(0, self.inverse)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(h, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, groups: _Groups | AttentionBackend, layer: int) -> torch.Tensor:
        qkv, scale = self.qkv(x), 1 / math.sqrt(self.head_dim)
        if isinstance(groups, _Groups):
            o = groups.attend(qkv, self.heads, self.head_dim, scale)
        else:  # (a runner's kernels: the whole batch in one call, both ways)
            q, k, v = qkv.view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
            o = groups.forward(layer, q, k, v, scale, None, None).reshape(x.shape[0], -1)
        x = self.attn_norm(x + self.attn_out(o))
        return self.ffn_norm(x + self.ffn_out(self.act(self.ffn_in(x))))


# Hugging Face layer-name fragment -> ours (q/k/v map to shards of the fused qkv)
_LAYER_NAMES = {"attention.output.dense.": "attn_out.", "attention.output.LayerNorm.": "attn_norm.",
                "intermediate.dense.": "ffn_in.", "output.dense.": "ffn_out.", "output.LayerNorm.": "ffn_norm."}
_QKV = {"attention.self.query.": 0, "attention.self.key.": 1, "attention.self.value.": 2}


class BertModel(nn.Module):
    """forward(input_ids [T], positions [T], token_type_ids [T] | None) -> hidden [T, H];
    pooled(hidden, query_lens) -> [B, H] (embedder) or [B, num_labels] logits (classifier). Attention: the forward
    context's backend where a runner gives one (its kernels, non-causal), else SDPA over groups of similar length."""
    causal = False

    def __init__(self, cfg: BertConfig, pooling_mode: str = "cls") -> None:
        super().__init__()
        self.config, self.pooling_mode = cfg, pooling_mode
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        if cfg.num_labels:
            self.pooler = nn.Linear(h, h)
            self.classifier = nn.Linear(h, cfg.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings(types)
        x = self.embed_norm(x)
        ctx = get_forward_context()
        groups = ctx.backend or _Groups(ctx.query_lens, input_ids.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, groups, i)
        return x

    def pooled(self, hidden: torch.Tensor, query_lens: list[int]) -> torch.Tensor:
        if not self.config.num_labels:
            return pool(hidden, query_lens, self.pooling_mode)
        cls = pool(hidden, query_lens, "cls").to(hidden.dtype)
        return self.classifier(torch.tanh(self.pooler(cls))).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        filled: set[str] = set()
        h = self.config.hidden_size
        for name, tensor in weights:
            name = name.removeprefix("bert.").replace(".gamma", ".weight").replace(".beta", ".bias")
            target, shard = _our_name(name, bool(self.config.num_labels))
            if target is None:
                continue
            if target not in params:
                raise KeyError(f"unexpected weight {name!r}")
            if shard is None:
                params[target].data.copy_(tensor.reshape(params[target].shape))
                filled.add(target)
            else:
                params[target].data[shard * h:(shard + 1) * h].copy_(tensor)
                filled.add(f"{target}#{shard}")
        missing = [n for n in params if not (n in filled or all(f"{n}#{i}" in filled for i in range(3)))]
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


def _our_name(name: str, classifier: bool) -> tuple[str | None, int | None]:
    """HF name -> (our parameter, qkv shard); (None, None) for tensors we do not use."""
    if name.startswith("embeddings."):
        rest = name.removeprefix("embeddings.")
        if rest.startswith("position_ids"):
            return None, None
        return ("embed_norm." + rest.removeprefix("LayerNorm.")) if rest.startswith("LayerNorm.") else rest, None
    if name.startswith("encoder.layer."):
        index, rest = name.removeprefix("encoder.layer.").split(".", 1)
        for frag, shard in _QKV.items():
            if rest.startswith(frag):
                return f"layers.{index}.qkv.{rest.removeprefix(frag)}", shard
        for frag, ours in _LAYER_NAMES.items():
            if rest.startswith(frag):
                return f"layers.{index}.{ours}{rest.removeprefix(frag)}", None
        return name, None
    if name.startswith("pooler.dense."):
        return ("pooler." + name.removeprefix("pooler.dense.")) if classifier else None, None
    if name.startswith("classifier."):
        return name, None
    if name.startswith("cls."):  # masked-LM / next-sentence heads
        return None, None
    return name, None
