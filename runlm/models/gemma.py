"""Gemma, Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences.

* embeddings scaled by sqrt(hidden_size);
* RMSNorm weights used as 1 + w: HF checkpoints store w (``config.norm_offset`` adds the 1 while
  loading), llama.cpp's converter stores 1 + w already;
* GELU-tanh MLP; from Gemma 2 on, a norm before and after both attention and the MLP ("sandwich" norms);
* queries scaled by query_pre_attn_scalar ** -0.5, attention scores (Gemma 2) and final logits
  soft-capped (cap * tanh(x / cap));
* sliding-window layers alternating with global ones (Gemma 2: 1:1, Gemma 3: 5:1, each with its own
  RoPE base on Gemma 3); q/k RMSNorm on Gemma 3.

The per-layer pieces (attention, MLP, norm) are llama.py's, configured by ModelConfig.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from runlm.models.config import ModelConfig
from runlm.models.linear import Weight
from runlm.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm
from runlm.models.rope import RotaryEmbedding


class GemmaDecoderLayer(DecoderLayer):
    fusable = True  # LlamaModel._forward_fused computes it, sandwich norms included

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__(cfg, layer, rope)  # attention, MLP, input and post-attention norms
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(LlamaModel):
    layer_cls: type[DecoderLayer] = GemmaDecoderLayer  # (the embeddings' scale: LlamaModel.embed)


class GemmaForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
        return offset_norms(weights, self.config.norm_offset)


class Gemma1Model(GemmaModel):
    layer_cls = DecoderLayer  # Llama's: a norm before attention and before the MLP


class Gemma1ForCausalLM(GemmaForCausalLM):
    model_cls = Gemma1Model


def offset_norms(weights: Iterable[tuple[str, Weight]], offset: float,
                 plain: str | None = None) -> Iterator[tuple[str, Weight]]:
    """Norm weights stored as w of an (offset + w) norm, as the sum; those whose names end with ``plain`` as stored
    (Qwen3-Next's gated norms have a plain weight)."""
    for name, tensor in weights:
        if offset and name.endswith("norm.weight") and isinstance(tensor, torch.Tensor) \
                and not (plain and name.endswith(plain)):
            tensor = tensor.float() + offset
        yield name, tensor
