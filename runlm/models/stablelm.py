"""StableLM (and Phi-2, StarCoder2, Cohere 2): the Llama decoder with LayerNorm (mean-centred; with a bias unless
``ModelConfig.norm_bias`` says not) for every norm, and optionally the parallel residual (transformers'
StableLmDecoderLayer: ``x + attn(ln(x)) + mlp(ln(x))``). Attention (partial rotary, q/k/v biases) and the MLPs are
llama.py's, configured by ModelConfig. The layers run on torch (the fused path's norms are RMSNorm)."""
from __future__ import annotations

import torch

from runlm.models.config import ModelConfig
from runlm.models.llama import DecoderLayer, LayerNorm, LlamaForCausalLM, LlamaModel
from runlm.models.rope import RotaryEmbedding


class StableLmDecoderLayer(DecoderLayer):
    fusable = False

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__(cfg, layer, rope)
        self.parallel = cfg.parallel_residual
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias)
        if self.parallel:  # one norm feeds both branches
            del self.post_attention_layernorm
        else:
            self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            h = self.input_layernorm(x)
            return x + self.self_attn(positions, h) + self.mlp(h)
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class StableLmModel(LlamaModel):
    layer_cls = StableLmDecoderLayer

    def __init__(self, cfg: ModelConfig, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__(cfg, rope_freq_factors)
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias)


class StableLmForCausalLM(LlamaForCausalLM):
    model_cls = StableLmModel
