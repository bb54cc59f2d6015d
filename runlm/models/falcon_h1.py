"""Falcon-H1: each layer runs attention and a Mamba2 mixer side by side on one norm's output, then a SwiGLU MLP:

    h = norm(x);  x = x + mamba(h) + attn(h);  x = x + mlp(norm(x))

Its µP multipliers (the mixers' inputs and outputs, the keys, the MLP's gate and down projections, each segment of
the Mamba2 input projection) are folded into the weights on loading, as llama.cpp's converter folds them into its
files; the embeddings' and logits' are ModelConfig.embed_scale and logit_scale."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from runlm.models.config import ModelConfig
from runlm.models.linear import GGMLWeight, Weight
from runlm.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm
from runlm.models.mamba2 import Mamba2Mixer
from runlm.models.rope import RotaryEmbedding


class FalconH1DecoderLayer(DecoderLayer):
    fusable = False

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        nn.Module.__init__(self)
        self.mamba = Mamba2Mixer(cfg, layer)
        self.self_attn = Attention(cfg, layer, rope)
        self.mlp: nn.Module = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        """The layer's recurrent mixer (its attention beside it is ``self_attn``)."""
        return self.mamba

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + self.mamba(positions, h) + self.self_attn(positions, h)
        return x + self.mlp(self.post_attention_layernorm(x))


class FalconH1Model(LlamaModel):
    layer_cls: type[DecoderLayer] = FalconH1DecoderLayer


class FalconH1ForCausalLM(LlamaForCausalLM):
    model_cls: type[LlamaModel] = FalconH1Model

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
        return fold_multipliers(weights, self.config)


def fold_multipliers(weights: Iterable[tuple[str, Weight]], cfg: ModelConfig) -> Iterator[tuple[str, Weight]]:
    """Each weight times its multiplier (ModelConfig.multipliers, as the HF config names them): row scales of the
    Mamba2 input projection's z, x, B, C and dt segments. A weight stored in blocks is dequantized to be scaled."""
    m = cfg.multipliers
    if not m:
        yield from weights
        return
    attn_in = float(m.get("attention_in_multiplier", 1.0))
    mlp = m.get("mlp_multipliers") or (1.0, 1.0)
    scales: Mapping[str, float] = {
        ".self_attn.q_proj.weight": attn_in, ".self_attn.v_proj.weight": attn_in,
        ".self_attn.k_proj.weight": attn_in * float(m.get("key_multiplier", 1.0)),
        ".self_attn.o_proj.weight": float(m.get("attention_out_multiplier", 1.0)),
        ".mamba.out_proj.weight": float(m.get("ssm_out_multiplier", 1.0)),
        ".mlp.gate_proj.weight": float(mlp[0]), ".mlp.down_proj.weight": float(mlp[1])}
    inner, groups = cfg.ssm_heads * cfg.ssm_head_dim, cfg.ssm_groups * cfg.ssm_state
    segments = [inner, inner, groups, groups, cfg.ssm_heads]
    zxbcdt = m.get("ssm_multipliers") or [1.0] * 5
    for name, w in weights:
        scale = next((s for suffix, s in scales.items() if name.endswith(suffix)), None)
        if name.endswith(".mamba.in_proj.weight"):
            rows = torch.cat([torch.full((n,), float(s)) for n, s in zip(segments, zxbcdt)])
            yield name, _dense(w) * (rows * float(m.get("ssm_in_multiplier", 1.0)))[:, None]
        elif scale is not None and scale != 1.0:
            yield name, _dense(w) * scale
        else:
            yield name, w


def _dense(w: Weight) -> torch.Tensor:
    if isinstance(w, GGMLWeight):
        return w.dense()
    assert isinstance(w, torch.Tensor)  # (safetensors: tensors or half-precision views)
    return w.float()
