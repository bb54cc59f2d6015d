"""Llama-family decoder: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM2.

Parameter names follow Hugging Face's so safetensors checkpoints load by name; Q/K/V and
gate/up projections are fused into one matmul each (fewer, larger matmuls are what a CPU
decode step is bound by), and ``load_weights`` stacks the separate checkpoint tensors.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from runlm import kernels
from runlm.kernels import fused, linear
from runlm.kernels.triton import runs_on
from runlm.models.attention import (
    get_forward_context,
    redo_bidirectional,
    rope_write_kv_and_attend,
    write_kv_and_attend,
)
from runlm.models.config import ModelConfig
from runlm.models.linear import BlockQuantized, Embedding, GGMLWeight, Int8Parts, Linear, Weight
from runlm.models.rope import RotaryEmbedding


def _triton_fused() -> Any:
    from runlm.kernels.triton import fused as triton_fused

    return triton_fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if runs_on(x.device.type):
            return _triton_fused().rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op, row by row; the same values as the formula below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, this norm of it): one launch on a device with the fused ops."""
        if runs_on(x.device.type):
            return _triton_fused().add_rms_norm(x, y, self.weight, self.eps)
        total = x + y
        return total, self(total)


class LayerNorm(nn.Module):
    """Mean-centred, with a bias or without (the norms of runlm.models.stablelm's families), in float32."""

    def __init__(self, dim: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias, self.eps).to(x.dtype)


class Held(nn.Module):
    """A tensor a layer uses as is (not as a linear map's weight), under the name ``<module>.weight``, held dense
    whatever the file stores: gpt-oss's attention sinks, latent attention's per-head matrices."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer, self.rope = layer, rope
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # Qwen3-Next: q_proj makes each head's query and then its output gate
        self.output_gate = cfg.attn_output_gate
        q_rows = 2 * self.q_size if self.output_gate else self.q_size
        self.qkv_proj = Linear(cfg.hidden_size, q_rows + 2 * self.kv_size, bias=cfg.attention_bias)
        # Llama/Mistral's attention_bias also covers o_proj; Qwen2's bias is on q/k/v only.
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:  # per head, or (OLMoE) over the whole projection
            self.q_norm = RMSNorm(self.q_size if cfg.qk_norm_whole else cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size if cfg.qk_norm_whole else cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm, self.qk_norm_whole, self.clip = cfg.qk_norm, cfg.qk_norm_whole, cfg.clip_qkv
        self.qk_norm_after_rope = cfg.qk_norm_after_rope
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.window = cfg.layer_window(layer)
        self.softcap = cfg.attn_logit_softcap
        self.sinks = Held(cfg.num_heads) if cfg.attention_sinks else None  # (gpt-oss)
        # Llama 4: chunked local attention, weightless q/k norms after RoPE on its RoPE layers, and on the others the
        # queries scaled up with the position (its attention temperature tuning)
        self.chunk = cfg.layer_chunk(layer)
        self.l2_norm = cfg.qk_l2_norm and layer not in cfg.nope_layers
        self.temperature = (cfg.attn_floor_scale, cfg.attn_temperature_scale) \
            if cfg.attn_floor_scale and layer in cfg.nope_layers else None
        self.eps = cfg.rms_norm_eps
        # what only this torch forward computes (the fused loop does not)
        self.torch_only = bool(self.qk_norm_whole or self.clip or self.qk_norm_after_rope or self.sinks is not None
                               or self.chunk or self.l2_norm or self.temperature or self.output_gate)
        # nothing between the rotation and the attention (rope_write_kv_and_attend may do both)
        self.rope_then_attend = not (self.qk_norm_after_rope or self.l2_norm or self.temperature is not None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        gate = None
        if self.output_gate:
            q_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, gate = q_gate.view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
            q = q.reshape(t, self.q_size)
        else:
            q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip:
            q, k, v = (t_.clamp(-self.clip, self.clip) for t_ in (q, k, v))
        q = q.reshape(t, self.heads, self.head_dim)
        k = k.reshape(t, self.kv_heads, self.head_dim)
        v = v.reshape(t, self.kv_heads, self.head_dim)
        head_norms = self.qk_norm and not self.qk_norm_whole and not self.qk_norm_after_rope
        if self.rope_then_attend:  # (q/k norms,) RoPE and the K/V store in one launch, where the backend can
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if head_norms else None
            o = rope_write_kv_and_attend(self.layer, positions, self.rope, q, k, v, self.scale, self.window,
                                         self.softcap, norms, None if self.sinks is None else self.sinks.weight,
                                         self.chunk)
            if o is not None:
                return self.o_proj((o if gate is None else o * torch.sigmoid(gate)).reshape(t, self.q_size))
        if head_norms:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        if self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.l2_norm:
            q, k = F.rms_norm(q.float(), (self.head_dim,), eps=self.eps).to(q.dtype), \
                F.rms_norm(k.float(), (self.head_dim,), eps=self.eps).to(k.dtype)
        if self.temperature is not None:
            floor, scale = self.temperature
            q = q * (torch.log1p(torch.floor((positions.float() + 1.0) / floor)) * scale + 1.0).view(-1, 1, 1)
        o = write_kv_and_attend(self.layer, q, k, v, self.scale, self.window, self.softcap,
                                None if self.sinks is None else self.sinks.weight, self.chunk)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * size, bias=cfg.mlp_bias)
        self.down_proj = Linear(size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu and self.limit is None and runs_on(x.device.type):
            return self.down_proj(_triton_fused().silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is not None:  # gpt-oss: both clamped, (up + 1) * gate * sigmoid(1.702 gate)
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * _SWIGLU_ALPHA)))
        return self.down_proj(self.act(gate) * up)


_SWIGLU_ALPHA = 1.702  # gpt-oss's (transformers' swiglu_alpha default, llama.cpp's constant)


class UngatedMLP(nn.Module):
    """up -> activation -> down, no gate (ModelConfig.gated_mlp False: Arcee's ReLU², Phi-2's GELU with biases,
    Apertus's xIELU)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or cfg.intermediate_size
        self.up_proj = Linear(cfg.hidden_size, size, bias=cfg.mlp_bias)
        self.down_proj = Linear(size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act: Callable[[torch.Tensor], torch.Tensor] = XIELU() if cfg.hidden_act == "xielu" else \
            _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class XIELU(nn.Module):
    """xIELU (Apertus), its parameters learned per layer: softplus(alpha_p) x² + beta x above zero, below it
    (expm1(min(x, eps)) - x) (beta + softplus(alpha_n)) + beta x, as transformers' XIELUActivation computes it."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
        self.beta, self.eps = nn.Parameter(torch.zeros(())), nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p, alpha_n = F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "relu2": _relu2,
}


class DecoderLayer(nn.Module):
    fusable = True  # LlamaModel._forward_fused computes it

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, rope)
        self.mlp: nn.Module = MLP(cfg) if cfg.gated_mlp else UngatedMLP(cfg)  # (experts: runlm.models.moe)
        self.input_layernorm: RMSNorm | LayerNorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm: RMSNorm | LayerNorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_carried(self, positions: torch.Tensor, x: torch.Tensor, carried: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward, with the previous layer's MLP output ``carried`` not yet added to x (added by this layer's
        first norm), and this layer's MLP output handed on the same way: (x, MLP output). RMSNorms only."""
        pre, post = cast(RMSNorm, self.input_layernorm), cast(RMSNorm, self.post_attention_layernorm)
        x, normed = pre.add_forward(x, carried) if carried is not None else (x, pre(x))
        x, normed = post.add_forward(x, self.self_attn(positions, normed))
        return x, self.mlp(normed)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        post = self.post_attention_layernorm
        if type(post) is RMSNorm:  # the residual add and the norm after it: one launch where the device fuses them
            x, normed = post.add_forward(x, self.self_attn(positions, self.input_layernorm(x)))
            return x + self.mlp(normed)
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(post(x))


class LlamaModel(nn.Module):
    layer_cls: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        length = min(cfg.max_position_embeddings, 8192)
        with torch.device("cpu"):  # tables are real data even when the module is built on "meta"
            rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, length, rope_freq_factors,
                                   cfg.rotary_dim)
            # sliding-window layers with a RoPE base of their own (Gemma 3) rotate unscaled
            local = RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta, None, length) if cfg.rope_local_theta else rope
            nope = RotaryEmbedding.identity(cfg.head_dim, length) if cfg.nope_layers else rope  # (SmolLM3)
        self.rope = rope
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = [self.layer_cls(cfg, i, nope if i in cfg.nope_layers else local if cfg.layer_window(i) else rope)
                  for i in range(cfg.num_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm: RMSNorm | LayerNorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # whether _forward_fused computes this model's layers (whole-head RoPE tables, a layer class it knows)
        self.supports_fused = (getattr(self.layer_cls, "fusable", False) and cfg.gated_mlp and rope.fusable
                               and local.fusable
                               and not any(layer.self_attn.torch_only for layer in layers))
        self.embed_scale = cfg.embed_scale or 1.0
        self.fused = False  # set by the loader in fast mode where runlm.kernels.fused is available
        self._plan: list[_FusedLayer] | None = None  # built at the first fused forward
        self._carry: bool | None = None  # _carries_residual, worked out once
        self._ropes: list[RotaryEmbedding] = []  # the plan's distinct RoPE tables

    def layer(self, i: int) -> DecoderLayer:
        """Layer i, typed (an nn.ModuleList's items are plain Modules to a type checker)."""
        layer = self.layers[i]
        assert isinstance(layer, DecoderLayer)
        return layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale if self.embed_scale != 1.0 else x  # (Gemma's sqrt(hidden), Granite's multiplier)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, ctx = self.embed(input_ids), get_forward_context()
        if ctx.mm_embeds is not None:  # an image's rows replace its placeholder tokens' (after any embedding scale)
            rows, values = ctx.mm_embeds
            x[rows] = values.to(x.dtype)
        # (M-RoPE's [3, T] positions take the layers' torch path)
        if self.fused and ctx.kv_caches is not None and ctx.backend is None and positions.ndim == 1:
            return self._forward_fused(x, positions)
        if runs_on(x.device.type) and self._carries_residual():
            # each layer's last residual add is the next norm's (one launch): the MLP's output carried over
            carried = None
            for layer in self.layers:
                x, carried = cast(DecoderLayer, layer).forward_carried(positions, x, carried)
            return cast(RMSNorm, self.norm).add_forward(x, carried)[1] if carried is not None else self.norm(x)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)

    def _carries_residual(self) -> bool:
        """Whether every layer is the plain DecoderLayer with RMSNorms (a family's own layer keeps its forward)."""
        if self._carry is None:
            self._carry = type(self.norm) is RMSNorm and all(
                type(layer) is DecoderLayer and type(layer.input_layernorm) is RMSNorm
                and type(layer.post_attention_layernorm) is RMSNorm for layer in self.layers)
        return self._carry

    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The same layers in ~8 native calls each (fast mode): the residual stream is added into in
        place, each RMSNorm is fused with the add before it, and one call splits QKV, normalizes and
        rotates q and k and writes K/V to the cache."""
        ops, ctx = fused.ops(), get_forward_context()
        assert ctx.kv_caches is not None  # forward() takes this path only with a cache
        if self._plan is None:
            self._plan = [_FusedLayer.of(self, i, ops) for i in range(len(self.layers))]
            self._ropes = list({id(p.rope): p.rope for p in self._plan}.values())
        for rope in self._ropes:
            rope.ensure_positions(int(positions.max()) + 1)
        t, residual = x.shape[0], x
        first = self.layer(0).input_layernorm
        h = ops.rms_norm(x, first.weight, first.eps)
        for i, (p, (k_cache, v_cache)) in enumerate(zip(self._plan, ctx.kv_caches)):
            slot_mapping, flat_slots, _ = ctx.slots_of(i)
            rope = p.rope
            q = ops.qkv_rope_store(p.qkv(h), positions, rope.cos, rope.sin, k_cache, v_cache, slot_mapping,
                                   p.heads, p.kv_heads, p.head_dim, rope.interleaved, p.q_norm, p.k_norm, p.eps)
            a = kernels.paged_attention(q, k_cache, v_cache, flat_slots, ctx.query_lens, ctx.context_lens, p.scale,
                                        p.window, p.softcap)
            assert a is not None  # fused mode is only set where the attention kernel is available
            if ctx.bidirectional is not None:
                a = redo_bidirectional(i, q, a, p.scale, p.window, p.softcap)
            o = p.o(a.view(t, -1))
            if p.attn_out_norm is not None:  # Gemma's sandwich norms
                o = ops.rms_norm(o, p.attn_out_norm, p.eps)
            h = ops.add_rms_norm(o, residual, p.mlp_norm, p.eps)
            m = p.mlp(h)
            if p.mlp_out_norm is not None:
                m = ops.rms_norm(m, p.mlp_out_norm, p.eps)
            h = ops.add_rms_norm(m, residual, p.next_norm, p.eps)
        return h


class _FusedLayer(NamedTuple):
    """What the fused loop needs of one layer, looked up once: nn.Module attribute access costs ~1 µs
    each, and a small model's decode step would otherwise spend ~0.5 ms on it."""
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    mlp: Callable[[torch.Tensor], torch.Tensor]  # [T, H] -> [T, H]: fused ops, or the layer's own (experts)
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    attn_out_norm: torch.Tensor | None  # Gemma: the norm of the attention output, before the residual add
    mlp_norm: torch.Tensor  # the norm of the MLP's input
    mlp_out_norm: torch.Tensor | None  # Gemma: the norm of the MLP's output
    next_norm: torch.Tensor  # the next layer's input norm, or the final norm
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    window: int | None
    softcap: float | None
    rope: RotaryEmbedding

    @classmethod
    def of(cls, model: LlamaModel, i: int, ops: Any) -> _FusedLayer:
        layer = model.layer(i)
        attn, mlp = layer.self_attn, layer.mlp
        following = model.layer(i + 1).input_layernorm if i + 1 < len(model.layers) else model.norm
        qn, kn = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
        pre_ff, post_ff = (getattr(layer, name, None) for name in ("pre_feedforward_layernorm",
                                                                    "post_feedforward_layernorm"))
        if isinstance(pre_ff, RMSNorm) and isinstance(post_ff, RMSNorm):  # Gemma's sandwich norms
            attn_out, mlp_norm, mlp_out = layer.post_attention_layernorm.weight, pre_ff.weight, post_ff.weight
        else:
            attn_out, mlp_norm, mlp_out = None, layer.post_attention_layernorm.weight, None
        return cls(attn.qkv_proj.direct_call(), attn.o_proj.direct_call(), _fused_mlp(mlp, ops), qn, kn,
                   attn_out, mlp_norm, mlp_out, following.weight,
                   layer.input_layernorm.eps, attn.heads, attn.kv_heads, attn.head_dim, attn.scale, attn.window,
                   attn.softcap, attn.rope)


def _fused_mlp(mlp: nn.Module, ops: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gated MLP as three native calls; any other MLP (a mixture of experts) as its module."""
    if not isinstance(mlp, MLP):
        return mlp
    gate_up, down = mlp.gate_up_proj.direct_call(), mlp.down_proj.direct_call()
    act = ops.gelu_tanh_mul if mlp.act is _ACTIVATIONS["gelu_tanh"] else ops.silu_mul
    return lambda h: down(act(gate_up(h)))


# checkpoint name fragment -> (fused parameter fragment, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_WHOLE = -1  # shard key of a checkpoint tensor that is the whole parameter


def stacked_target(name: str, params: Container[str]) -> tuple[str, int]:
    """(the parameter a checkpoint tensor fills, its shard): q/k/v into qkv_proj, gate/up into gate_up_proj where
    the model has that fused parameter (an ungated MLP keeps its up_proj); else the whole parameter ``name``."""
    for frag, (fused_frag, index) in _STACKED.items():
        if frag in name:
            fused = name.replace(frag, fused_frag)
            return (fused, index) if fused in params else (name, _WHOLE)
    return name, _WHOLE


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T]) -> hidden [T, H]; compute_logits(hidden) -> [N, vocab]."""
    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, cfg: ModelConfig, rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_cls(cfg, rope_freq_factors)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size,
                                                                   bias=cfg.lm_head_bias)
        # tied embeddings stored quantized: the logits read the blocks (int8 or as stored)
        self.tied_head: Linear | None = None
        # tensor parallelism (runlm.models.tp_shard): this rank's vocabulary columns -> every rank's, on rank 0
        self.gather_vocab: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.tied_head is not None:
            logits = self.tied_head(hidden)
        else:
            logits = linear(hidden, self.model.embed_tokens.weight)
        if self.gather_vocab is not None:
            logits = self.gather_vocab(logits)
        scale = self.config.logit_scale  # (Granite's, Cohere's)
        return logits * scale if scale != 1.0 else logits

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding weights, each once: parameters, buffers and views of the GGUF file."""
        found = [*self.parameters(), *self.buffers()]
        for m in self.modules():
            if isinstance(m, Linear):
                found += [s.raw for s in m.ggml]
            elif isinstance(m, Embedding) and m.ggml is not None:
                found.append(m.ggml.raw)
        unique = {(t.data_ptr(), t.numel() * t.element_size()): t for t in found if t.device.type != "meta"}
        return list(unique.values())

    def release_weights(self) -> None:
        """Drop every weight (sleep level 2): parameters go to "meta", views of the file are let go."""
        self.to_empty(device="meta")
        self.tied_head = None
        self.model._plan = None
        for m in self.modules():
            if isinstance(m, Linear) and m.ggml:
                m.keep_ggml([])
            elif isinstance(m, Embedding):
                m.ggml = None

    @staticmethod
    def _num_shards(param: str) -> int:
        return 3 if ".qkv_proj." in param else 2 if ".gate_up_proj." in param else 1

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
        """The checkpoint's HF-named tensors as this family's parameters take them (Gemma's norms stored as w of
        1 + w): every loader's first step, the GPU runner's too (runlm.models.gpu_load)."""
        return weights

    def decoder_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """checkpoint_weights, less the multi-token-prediction layers past the decoder's (GLM-4.5's,
        DeepSeek-V3's): what every loader fills the parameters from."""
        n = self.config.num_layers
        for name, tensor in self.checkpoint_weights(weights):
            layer = _LAYER.match(name)
            if layer is None or int(layer.group(1)) < n:
                yield name, tensor

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Fill every parameter from HF-named weights: fp32 tensors, int8 blocks (BlockQuantized) or
        GGUF blocks as stored (GGMLWeight). The model may be built on "meta": parameters are
        materialized here, and a layer served from blocks never gets an fp32 weight at all."""
        shards: dict[str, dict[int, Weight]] = {}  # parameter -> shard -> weight
        params = dict(self.named_parameters())
        for name, tensor in self.decoder_weights(weights):
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue  # tied checkpoints sometimes carry a copy
            # (a fused parameter stored fused, Phi-3's qkv_proj and gate_up_proj, is the whole parameter)
            target, shard = stacked_target(name, params)
            shards.setdefault(target, {})[shard] = tensor
        unexpected = [name for name in shards if name not in params]
        if unexpected:
            raise KeyError(f"unexpected weight {unexpected[0]!r}")
        missing = [f"{name}#{i}" for name in params for i in range(self._num_shards(name))
                   if i not in shards.get(name, {}) and _WHOLE not in shards.get(name, {})]
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
        for name, parts in shards.items():
            self._set_weight(name, [parts[_WHOLE]] if _WHOLE in parts else
                             [parts[i] for i in range(self._num_shards(name))])

    def _set_weight(self, name: str, values: list[Weight]) -> None:
        module_name, attr = name.rsplit(".", 1)
        module = self.get_submodule(module_name)
        shape = getattr(module, attr).shape
        blocks = [v for v in values if isinstance(v, GGMLWeight)]
        if attr == "weight" and len(blocks) == len(values):
            if sum(v.rows for v in blocks) != shape[0] or any(v.cols != shape[1] for v in blocks):
                raise RuntimeError(f"{name}: stored as {[(v.rows, v.cols) for v in blocks]}, expected {tuple(shape)}")
            if isinstance(module, Embedding):
                module.keep_ggml(blocks[0])
                if self.lm_head is None:  # tied: the logits read the same blocks
                    self.tied_head = Linear(shape[1], shape[0], bias=False, device="meta")
                    self.tied_head.keep_ggml(blocks)
            else:
                assert isinstance(module, Linear), name  # only embeddings and linear layers are stored as blocks
                module.keep_ggml(blocks)
            return
        int8 = [v for v in values if isinstance(v, BlockQuantized)]
        if len(int8) == len(values):
            parts = Int8Parts.cat([v.int8_parts() for v in int8])
            if isinstance(module, Linear):
                module.keep_quantized(parts)
                return
            if isinstance(module, Embedding) and self.lm_head is None:  # lookup keeps fp32 rows, logits int8
                self.tied_head = Linear(shape[1], shape[0], bias=False, device="meta")
                self.tied_head.keep_quantized(parts)
        dense = [v.dense() if isinstance(v, GGMLWeight) else v.dense if isinstance(v, BlockQuantized) else v
                 for v in values]
        tensor = dense[0] if len(dense) == 1 else torch.cat(dense)
        if tensor.numel() != shape.numel():
            raise RuntimeError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit {tuple(shape)}")
        setattr(module, attr, nn.Parameter(tensor.reshape(shape).float().contiguous(), requires_grad=False))
