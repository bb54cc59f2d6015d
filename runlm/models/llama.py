"""Llama-family decoder: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM2.

Parameter names follow Hugging Face's so safetensors checkpoints load by name; Q/K/V and
gate/up projections are fused into one matmul each (fewer, larger matmuls are what a CPU
decode step is bound by), and ``load_weights`` stacks the separate checkpoint tensors.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from runlm.kernels import linear
from runlm.models.attention import paged_attention
from runlm.models.config import ModelConfig
from runlm.models.linear import BlockQuantized, Int8Parts, Linear
from runlm.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op, row by row; the same values as the formula below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer, self.rope = layer, rope
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # Llama/Mistral's attention_bias also covers o_proj; Qwen2's bias is on q/k/v only.
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias and cfg.family != "qwen2")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.sliding_window

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = v.view(t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        o = paged_attention(self.layer, q, k, v, self.scale, self.window)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, rope)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        with torch.device("cpu"):  # tables are real data even when the module is built on "meta"
            rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                   min(cfg.max_position_embeddings, 8192), rope_freq_factors)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


# checkpoint name fragment -> (fused parameter fragment, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; compute_logits(hidden) -> [N, vocab]."""

    def __init__(self, cfg: ModelConfig, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, rope_freq_factors)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # tied embeddings stored quantized: the lookup keeps fp32 rows, the logits read the int8 copy
        self.tied_head: Linear | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self.tied_head is not None:
            return self.tied_head(hidden)
        return linear(hidden, self.model.embed_tokens.weight)

    def _shard_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == ".qkv_proj.":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        quantized: dict[str, dict[int, Int8Parts]] = {}  # parameter -> shard -> its int8 parts
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes carry a copy
            if isinstance(tensor, BlockQuantized):  # keep only the int8 parts; dense goes into the parameter
                block, tensor = tensor.int8_parts(), tensor.dense
            else:
                block = None
            for frag, (fused, shard) in _STACKED.items():
                if frag in name:
                    target = name.replace(frag, fused)
                    sizes = self._shard_sizes(fused)
                    offset = sum(sizes[:shard])
                    params[target].data[offset:offset + sizes[shard]].copy_(tensor)
                    filled.add(f"{target}#{shard}")
                    break
            else:
                target, shard = name, 0
                if name not in params:
                    raise KeyError(f"unexpected weight {name!r}")
                params[name].data.copy_(tensor.reshape(params[name].shape))
                filled.add(name)
            if block is not None:
                quantized.setdefault(target, {})[shard] = block
        missing = []
        for name, p in params.items():
            fused = next((f for f in (".qkv_proj.", ".gate_up_proj.") if f in name), None)
            if fused:
                missing += [f"{name}#{i}" for i in range(len(self._shard_sizes(fused))) if f"{name}#{i}" not in filled]
            elif name not in filled:
                missing.append(name)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
        self._keep_quantized(quantized)

    def _keep_quantized(self, quantized: dict[str, dict[int, Int8Parts]]) -> None:
        """Layers whose every shard came block-quantized serve from int8 (the fused ones need all shards)."""
        for name, shards in quantized.items():
            fused = next((f for f in (".qkv_proj.", ".gate_up_proj.") if f in name), None)
            if len(shards) != (len(self._shard_sizes(fused)) if fused else 1):
                continue
            parts = Int8Parts.cat([shards[i] for i in sorted(shards)])
            if name == "model.embed_tokens.weight":
                if self.lm_head is None:
                    rows, cols = parts.qweight.shape
                    self.tied_head = Linear(cols, rows, bias=False, device="meta")
                    self.tied_head.keep_quantized(parts)
                continue
            module = self.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(module, Linear):
                module.keep_quantized(parts)
