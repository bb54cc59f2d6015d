"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with its gated shared expert), Qwen3-MoE, OLMoE.

Llama's decoder with the MLP of (most) layers replaced by a sparse block: a router picks each token's
top-k experts from a softmax over all of them (renormalized where the family does), and every expert
is a Llama MLP. Tokens are grouped by expert, so a step reads each chosen expert's weights once
whatever the batch. GGUF files stack each layer's experts in one tensor per projection
(``ffn_gate_exps`` ...); the loader hands out one view per expert, so in fast mode the experts stay in
the file's blocks.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from runlm.models.config import ModelConfig
from runlm.models.linear import Linear, Weight
from runlm.models.llama import MLP, DecoderLayer, LlamaForCausalLM, LlamaModel
from runlm.models.rope import RotaryEmbedding


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(MLP(cfg, cfg.expert_size) for _ in range(cfg.num_experts))
        self.shared_expert: MLP | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():  # ascending, as transformers adds them
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeDecoderLayer(DecoderLayer):
    fusable = True  # the fused loop computes its attention and calls its MLP (experts or dense) as is

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__(cfg, layer, rope)
        if cfg.is_moe_layer(layer):
            self.mlp = SparseMoeBlock(cfg)


class MoeModel(LlamaModel):
    layer_cls = MoeDecoderLayer


class MoeForCausalLM(LlamaForCausalLM):
    model_cls = MoeModel

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        super().load_weights(_hf_moe_names(weights))


# Mixtral's checkpoint names -> the Qwen-MoE names the modules use
_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def _hf_moe_names(weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    for name, tensor in weights:
        if ".block_sparse_moe." in name:
            for old, new in _MIXTRAL_NAMES.items():
                name = name.replace(old, new)
        yield name, tensor
