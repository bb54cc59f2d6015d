"""Multi-head latent attention (DeepSeek-V2/V3, MLA), over a cache that holds the compressed latent.

Each token's keys and values are compressed into one latent vector ``c`` (``kv_lora_rank`` values, normalized) and one
shared RoPE key ``k_pe`` (``qk_rope_head_dim`` values): those two are what the cache stores, one row of
kv_lora_rank + qk_rope_head_dim values per token and layer, instead of every head's K and V. Attention runs on the
latent itself ("absorbed", as DeepSeek's inference and llama.cpp's do): each head's no-RoPE query is carried into the
latent space through that head's key up-projection (W_UK), so a score is

    q . k = (q_nope W_UK) . c + q_pe . k_pe

one query of kv_lora_rank + qk_rope_head_dim values per head against one shared key per token (multi-query
attention), and the value is the latent itself, carried out of it per head through W_UV after the softmax. The same
numbers as decompressing K and V per head (transformers' way), in another order of sums.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runlm.kernels.triton.reference import causal_mask
from runlm.models.attention import get_forward_context
from runlm.models.config import ModelConfig
from runlm.models.linear import Linear, Weight
from runlm.models.llama import Held, RMSNorm
from runlm.models.moe import MoeDecoderLayer, MoeForCausalLM, MoeModel
from runlm.models.rope import RotaryEmbedding


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the scaling names one."""
    scale = cfg.head_dim ** -0.5
    scaling: Mapping[str, Any] = cfg.rope_scaling or {}
    m_all = scaling.get("mscale_all_dim")
    factor = float(scaling.get("factor", 1.0))
    if m_all and factor > 1:
        scale *= (0.1 * float(m_all) * math.log(factor) + 1.0) ** 2
    return scale


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer, self.rope = layer, rope
        h, heads = cfg.hidden_size, cfg.num_heads
        self.heads, self.rank, self.rope_dim = heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope_dim, self.v_dim = cfg.head_dim - cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:  # (V3) the query through its own low-rank pair
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * cfg.head_dim, bias=False)
        else:
            self.q_proj = Linear(h, heads * cfg.head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.k_b_proj = Held(heads, self.nope_dim, self.rank)  # W_UK: the latent's keys, per head
        self.v_b_proj = Held(heads, self.v_dim, self.rank)  # W_UV: its values
        self.o_proj = Linear(heads * self.v_dim, h, bias=cfg.attention_bias)
        self.scale = softmax_scale(cfg)
        self.q_lora = bool(cfg.q_lora_rank)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(t, self.heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        q_pe, k_pe = self.rope(positions, q_pe, k_pe.view(t, 1, self.rope_dim))
        q_latent = torch.einsum("thn,hnr->thr", q_nope, self.k_b_proj.weight)
        latent = torch.cat((self.kv_a_layernorm(c).view(t, 1, self.rank), k_pe), dim=-1)
        o = write_latent_and_attend(self.layer, torch.cat((q_latent, q_pe), dim=-1), latent, self.rank, self.scale)
        o = torch.einsum("thr,hvr->thv", o, self.v_b_proj.weight)
        return self.o_proj(o.reshape(t, self.heads * self.v_dim))


def write_latent_and_attend(layer: int, q: torch.Tensor, latent: torch.Tensor, rank: int,
                            scale: float) -> torch.Tensor:
    """Store the new tokens' latents ([T, 1, D]) in layer ``layer``'s cache (its K half; the V half is empty, or on
    the GPU runner the same tensor), then attend each head's query ([T, H, D]) over each sequence's cached latents,
    the first ``rank`` values of which are the values. Returns [T, H, rank]."""
    ctx = get_forward_context()
    if ctx.backend is not None:  # (the GPU runner's paged cache of latents: one KV head whose values are its first)
        return ctx.backend.forward(layer, q, latent, latent, scale, None, None)[..., :rank]
    cache, context_slots = None, None
    if ctx.kv_caches is not None:
        cache = ctx.kv_caches[layer][0]
        slot_mapping, _, context_slots = ctx.slots_of(layer)
        assert slot_mapping is not None and context_slots is not None
        cache.index_copy_(0, slot_mapping, latent.to(cache.dtype))
    out = q.new_empty(q.shape[0], q.shape[1], rank)
    start = 0
    for i, q_len in enumerate(ctx.query_lens):
        end = start + q_len
        ks = cache.index_select(0, context_slots[i]) if cache is not None and context_slots else latent[start:end]
        ks = ks.transpose(0, 1).to(q.dtype)  # [1, L, D]
        mask = causal_mask(q_len, ctx.context_lens[i], None, q.device)
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), ks, ks[..., :rank], attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
        start = end
    return out


class DeepseekDecoderLayer(MoeDecoderLayer):
    fusable = False  # (the fused loop knows per-head K/V only)

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__(cfg, layer, rope)
        self.self_attn = LatentAttention(cfg, layer, rope)  # type: ignore[assignment]


class DeepseekModel(MoeModel):
    layer_cls = DeepseekDecoderLayer


class DeepseekForCausalLM(MoeForCausalLM):
    model_cls = DeepseekModel

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
        return _split_kv_b(super().checkpoint_weights(weights), self.config)


def _split_kv_b(weights: Iterable[tuple[str, Weight]], cfg: ModelConfig) -> Iterator[tuple[str, Weight]]:
    """HF's ``kv_b_proj`` [H * (nope + v), rank] as W_UK [H, nope, rank] and W_UV [H, v, rank]; llama.cpp's
    ``attn_k_b`` is W_UK transposed ([H, rank, nope]), its ``attn_v_b`` W_UV."""
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    for name, tensor in weights:
        if name.endswith(".kv_b_proj.weight"):
            w = _dense(tensor).view(cfg.num_heads, nope + cfg.v_head_dim, cfg.kv_lora_rank)
            yield name.replace(".kv_b_proj.", ".k_b_proj."), w[:, :nope]
            yield name.replace(".kv_b_proj.", ".v_b_proj."), w[:, nope:]
        elif name.endswith(".k_b_proj.weight"):
            yield name, _dense(tensor).view(cfg.num_heads, cfg.kv_lora_rank, nope).transpose(1, 2)
        elif name.endswith(".v_b_proj.weight"):
            yield name, _dense(tensor).view(cfg.num_heads, cfg.v_head_dim, cfg.kv_lora_rank)
        else:
            yield name, tensor


def _dense(w: Weight) -> torch.Tensor:
    from runlm.models.linear import BlockQuantized, GGMLWeight

    return w.dense() if isinstance(w, GGMLWeight) else w.dense if isinstance(w, BlockQuantized) else w
