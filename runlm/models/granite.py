"""Granite 3: the Llama decoder with IBM's multipliers (ModelConfig.embed_scale, residual_scale,
query_pre_attn_scalar, logit_scale), as transformers' GraniteForCausalLM computes them:

    x = embed(ids) * embedding_multiplier
    x = x + attn(norm(x)) * residual_multiplier;  x = x + mlp(norm(x)) * residual_multiplier
    scores = q . k * attention_multiplier;  logits = lm_head(norm(x)) / logits_scaling

The layers run on torch (the fused path adds branches unscaled)."""
from __future__ import annotations

import torch

from runlm.models.config import ModelConfig
from runlm.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel
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
    model_cls = GraniteModel  # (the logits' multiplier: LlamaForCausalLM.compute_logits)
