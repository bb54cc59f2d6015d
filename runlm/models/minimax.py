"""MiniMax (MiniMax-Text-01, MiniMax-M1 as transformers writes them): lightning attention -- linear attention whose
per-head state decays at a fixed rate -- on most layers, softmax attention on every eighth, Mixtral's experts after
each, and DeepNorm's residuals around the normed input (the factors from the config):

    h = norm(x);  h = h * alpha_attn + attn(h) * beta_attn;  h = norm'(h);  x = h * alpha_mlp + mlp(h) * beta_mlp

Lightning attention: q, k, v = silu(qkv_proj(h)) per head;  S_t = exp(-s) S_(t-1) + v_t k_t^T;  o_t = S_t q_t, its
decay s per head falling with the layer's depth; then rmsnorm over all heads, times sigmoid(output_gate(h)), out_proj.
That is runlm.models.mamba2.ssd_scan with every step 1, A = -s, x = v, B = k, C = q; the state is float32."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from runlm.models.config import ModelConfig
from runlm.models.linear import Linear, Weight
from runlm.models.llama import Attention, DecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm
from runlm.models.mamba2 import Slots, by_sequence, ssd_scan
from runlm.models.moe import SparseMoeBlock, mixtral_names
from runlm.models.rope import RotaryEmbedding


class LightningAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.head_dim = layer, cfg.num_heads, cfg.head_dim
        inner = cfg.num_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, 3 * inner, bias=False)
        self.output_gate = Linear(cfg.hidden_size, inner, bias=False)
        self.out_proj = Linear(inner, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(inner, 1e-6)  # (transformers' MiniMaxRMSNorm default: the config's eps is not passed)
        # each head's decay: (1 / 2^(8 / heads))^(h + 1), less in deeper layers
        base = 1 / (2 ** (8 / cfg.num_heads))
        depth = 1 - layer / (cfg.num_layers - 1 + 1e-5) + 1e-5
        self.decay = [base ** (h + 1) * depth for h in range(cfg.num_heads)]  # (floats: the model is built on meta)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = F.silu(self.qkv_proj(x))
        o = by_sequence(self.layer, [qkv], self.heads * self.head_dim, self._run)
        o = self.norm(o.to(x.dtype))
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * o)

    def _run(self, inputs: list[torch.Tensor], slots: Slots) -> torch.Tensor:
        b, length = inputs[0].shape[:2]
        q, k, v = inputs[0].float().view(b, length, self.heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        decay = torch.tensor(self.decay, dtype=torch.float32, device=q.device)
        state = slots.load(1, (b, self.heads, self.head_dim, self.head_dim), q)
        out, state = ssd_scan(v, q.new_ones(b, length, self.heads), -decay, k, q, state)
        slots.keep(1, state)
        return out.reshape(b, length, self.heads * self.head_dim)


class MiniMaxDecoderLayer(DecoderLayer):
    fusable = False

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        nn.Module.__init__(self)
        linear = layer in cfg.recurrent_layers
        self.self_attn: nn.Module = LightningAttention(cfg, layer) if linear else Attention(cfg, layer, rope)  # type: ignore[assignment]
        self.mlp: nn.Module = SparseMoeBlock(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        m, kind = cfg.multipliers, "linear_attn" if linear else "full_attn"
        self.attn_alpha, self.attn_beta = (float(m.get(f"{kind}_{f}_factor", 1.0)) for f in ("alpha", "beta"))
        self.mlp_alpha, self.mlp_beta = (float(m.get(f"mlp_{f}_factor", 1.0)) for f in ("alpha", "beta"))

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.post_attention_layernorm(h * self.attn_alpha + self.self_attn(positions, h) * self.attn_beta)
        return h * self.mlp_alpha + self.mlp(h) * self.mlp_beta


class MiniMaxModel(LlamaModel):
    layer_cls: type[DecoderLayer] = MiniMaxDecoderLayer


class MiniMaxForCausalLM(LlamaForCausalLM):
    model_cls: type[LlamaModel] = MiniMaxModel

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
        # (checkpoints carry the decays as buffers; they follow from the layer's depth, and are computed so)
        return ((name, w) for name, w in mixtral_names(weights) if not name.endswith(_DERIVED))


_DERIVED = (".slope_rate", ".query_decay", ".key_decay", ".diagonal_decay")
