"""OLMo 2: the Llama decoder with its norms after attention and after the MLP instead of before them (each output
normalized, then added to the residual), and q/k RMSNorm over the whole projection (ModelConfig.qk_norm_whole).
The per-layer pieces are llama.py's; the fused loop does not compute this arrangement, so fast mode runs the
layers op by op (on GGUF blocks all the same)."""
from __future__ import annotations

import torch

from runlm.models.config import ModelConfig
from runlm.models.llama import DecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm
from runlm.models.rope import RotaryEmbedding


class Olmo2DecoderLayer(DecoderLayer):
    fusable = False

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__(cfg, layer, rope)
        del self.input_layernorm  # no norm before attention: post_attention_layernorm follows it
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, x))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(LlamaModel):
    layer_cls = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model
