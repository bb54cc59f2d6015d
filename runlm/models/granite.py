"""Granite 3: the Llama decoder with IBM's multipliers (ModelConfig.embed_scale, residual_scale,
query_pre_attn_scalar, logit_scale), as transformers' GraniteForCausalLM computes them:

    x = embed(ids) * embedding_multiplier
    x = x + attn(norm(x)) * residual_multiplier;  x = x + mlp(norm(x)) * residual_multiplier
    scores = q . k * attention_multiplier;  logits = lm_head(norm(x)) / logits_scaling

The layers run on torch (the fused path adds branches unscaled)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from runlm.models.config import ModelConfig
from runlm.models.hybrid import HybridForCausalLM
from runlm.models.linear import Weight
from runlm.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel
from runlm.models.moe import SparseMoeBlock
from runlm.models.rope import RotaryEmbedding


class GraniteDecoderLayer(DecoderLayer):
    fusable = False

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__(cfg, layer, rope)
        self.residual_scale = cfg.residual_scale

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x)) * self.residual_scale
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_scale


class GraniteModel(LlamaModel):
    layer_cls: type[DecoderLayer] = GraniteDecoderLayer  # (the embeddings' multiplier: LlamaModel.embed)


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls: type[LlamaModel] = GraniteModel  # (the logits' multiplier: LlamaForCausalLM.compute_logits)


class GraniteMoeDecoderLayer(GraniteDecoderLayer):
    """Granite 3's multipliers around a mixture of experts (GraniteMoE: softmax router, top-k renormalized)."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__(cfg, layer, rope)
        self.mlp = SparseMoeBlock(cfg)


class GraniteMoeModel(GraniteModel):
    layer_cls: type[DecoderLayer] = GraniteMoeDecoderLayer


class GraniteMoeForCausalLM(GraniteForCausalLM):
    model_cls = GraniteMoeModel

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
        return super().checkpoint_weights(_per_expert(weights, self.config.expert_size))


class GraniteHybridForCausalLM(HybridForCausalLM):
    """Granite 4 (GraniteMoeHybrid): the hybrid layers (runlm.models.hybrid) with Granite's multipliers, experts
    stacked in the checkpoint as GraniteMoE's and its always-on MLP (``shared_mlp``)."""

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
        cfg = self.config
        shared = "mlp.shared_expert" if cfg.num_experts else "mlp"  # (a model without experts: the MLP alone)
        return super().checkpoint_weights(_per_expert(weights, cfg.expert_size, shared,
                                                      cfg.shared_expert_intermediate_size))


def _per_expert(weights: Iterable[tuple[str, Weight]], size: int, shared: str = "",
                shared_size: int = 0) -> Iterator[tuple[str, Weight]]:
    """GraniteMoE's checkpoint names: each layer's experts stacked, gate and up in one ``input_linear`` [E, 2I, H]
    (gate first), ``output_linear`` [E, H, I], the router ``router.layer``; as one weight per expert. Granite 4's
    ``shared_mlp`` (``input_linear`` [2S, H], ``output_linear``) as the module ``shared``'s gate, up and down."""
    for name, tensor in weights:
        prefix, _, rest = name.partition(".block_sparse_moe.")
        head, _, mlp = name.partition(".shared_mlp.")
        if mlp:
            assert isinstance(tensor, torch.Tensor), name  # (llama.cpp's files split it: ffn_*_shexp)
            if mlp == "input_linear.weight":
                yield f"{head}.{shared}.gate_proj.weight", tensor[:shared_size]
                yield f"{head}.{shared}.up_proj.weight", tensor[shared_size:]
            else:
                yield f"{head}.{shared}.down_proj.weight", tensor
        elif not rest:
            yield name, tensor
        elif rest == "router.layer.weight":
            yield f"{prefix}.mlp.gate.weight", tensor
        else:
            assert isinstance(tensor, torch.Tensor), name  # (3-D: read dense)
            for e, w in enumerate(tensor):
                if rest == "input_linear.weight":
                    yield f"{prefix}.mlp.experts.{e}.gate_proj.weight", w[:size]
                    yield f"{prefix}.mlp.experts.{e}.up_proj.weight", w[size:]
                else:
                    yield f"{prefix}.mlp.experts.{e}.down_proj.weight", w
