"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with its gated shared expert), Qwen3-MoE, OLMoE.

Llama's decoder with the MLP of (most) layers replaced by a sparse block: a router picks each token's
top-k experts from a softmax over all of them (renormalized where the family does), and every expert
is a Llama MLP. Tokens are grouped by expert, so a step reads each chosen expert's weights once
whatever the batch. GGUF files stack each layer's experts in one tensor per projection
(``ffn_gate_exps`` ...); the loader hands out one view per expert, so in fast mode the experts stay in
the file's blocks.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runlm.kernels.triton import runs_on
from runlm.models.config import ModelConfig
from runlm.models.linear import Linear, Weight
from runlm.models.llama import MLP, DecoderLayer, LlamaForCausalLM, LlamaModel, UngatedMLP
from runlm.models.rope import RotaryEmbedding


class ScoreBias(nn.Module):
    """The per-expert bias a router adds to its scores to choose experts (DeepSeek-V3's e_score_correction_bias)."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(experts))


@dataclass
class StackedExperts:
    """A layer's experts stacked for the GPU runner's fused kernel (runlm.kernels.triton.fused_moe; set by
    runlm.models.gpu_blocks.stack_experts): each projection [E, N, K] in the model's dtype (type 0) or uint8
    [E, N, row_bytes] in a ggml block type; the experts' own weights are views of these."""
    gate_up: torch.Tensor
    gate_up_type: int
    down: torch.Tensor
    down_type: int


class SparseMoeBlock(nn.Module):
    stacked: StackedExperts | None = None  # the GPU runner's fused path, where its experts could be stacked
    unstacked = "not loaded for the GPU runner"  # else why not

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.sigmoid, self.scaling = cfg.moe_gating == "sigmoid", cfg.routed_scaling
        self.groups, self.groups_used, self.group_max = cfg.moe_groups, cfg.moe_groups_used, cfg.moe_group_max
        self.weight_input = cfg.moe_weight_input
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)  # the router
        self.score_bias = ScoreBias(cfg.num_experts) if cfg.moe_score_bias else None
        # (ungated experts, up -> activation -> down, where the family's MLP is: Nemotron-H's ReLU²)
        mlp: type[MLP] | type[UngatedMLP] = MLP if cfg.gated_mlp else UngatedMLP
        self.experts = nn.ModuleList(mlp(cfg, cfg.expert_size) for _ in range(cfg.num_experts))
        self.shared_expert: MLP | UngatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = mlp(cfg, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights ([T, top_k] each), as the family's router picks them: scores by
        softmax or sigmoid, the choice among the best groups by scores plus the choice bias, the weights the chosen
        experts' unbiased scores (renormalized and scaled where the family does). A group's score is its two best
        experts' scores summed (DeepSeek-V3), or its best one's (DeepSeek-V2)."""
        logits = self.gate(x).float()
        scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        if self.score_bias is None and self.groups == 1:
            weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        else:
            choice = scores if self.score_bias is None else scores + self.score_bias.bias.float()
            if self.groups > 1:
                grouped = choice.view(choice.shape[0], self.groups, -1)
                score = grouped.amax(dim=-1) if self.group_max else grouped.topk(2, dim=-1).values.sum(dim=-1)
                best = score.topk(self.groups_used, dim=-1).indices
                keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
                choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
            chosen = torch.topk(choice, self.top_k, dim=-1).indices
            weights = scores.gather(1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling if self.scaling != 1.0 else weights, chosen

    def routes_on_device(self, device_type: str) -> str | None:
        """None where a step's routing and experts stay on the device (the fused kernel: CUDA graphs can capture
        them), else why not."""
        if self.stacked is None:
            return self.unstacked
        return None if runs_on(device_type) else "the fused experts kernel needs Triton"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stacked is not None and runs_on(x.device.type):
            return self._fused(x)
        weights, chosen = self.route(x)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():  # ascending, as transformers adds them
            token, slot = torch.where(chosen == e)
            w, expert = weights[token, slot, None], self.experts[e]
            out.index_add_(0, token, expert(x[token] * w) if self.weight_input else expert(x[token]) * w)
        return self._add_shared(x, out)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts in two grouped GEMMs on the device: no row grouped on the host, nothing read back."""
        from runlm.kernels.triton.fused_moe import fused_experts

        s = self.stacked
        assert s is not None
        x2 = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(x2)
        out = fused_experts(x2, weights, chosen, s.gate_up, s.gate_up_type, s.down, s.down_type)
        return self._add_shared(x, out.view_as(x))

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared


def host_routed_experts(model: nn.Module, device_type: str) -> str | None:
    """Why some mixture-of-experts layer of ``model`` routes its tokens on the host on this kind of device (so no
    CUDA graph can hold a step), or None."""
    return next((why for m in model.modules() if isinstance(m, SparseMoeBlock)
                 and (why := m.routes_on_device(device_type)) is not None), None)


class MoeDecoderLayer(DecoderLayer):
    fusable = True  # the fused loop computes its attention and calls its MLP (experts or dense) as is

    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> None:
        super().__init__(cfg, layer, rope)
        if cfg.is_moe_layer(layer):
            self.mlp = SparseMoeBlock(cfg)


class MoeModel(LlamaModel):
    layer_cls = MoeDecoderLayer


class MoeForCausalLM(LlamaForCausalLM):
    model_cls = MoeModel

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
        return mixtral_names(weights)


# Mixtral's checkpoint names -> the Qwen-MoE names the modules use
_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


def mixtral_names(weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    """Mixtral's expert names (``block_sparse_moe.experts.N.w1``, ...; MiniMax's too) as the modules name them."""
    for name, tensor in weights:
        if ".block_sparse_moe." in name:
            for old, new in _MIXTRAL_NAMES.items():
                name = name.replace(old, new)
        yield name, tensor


def stacked_experts(weights: Iterable[tuple[str, Weight]], interleaved: bool) -> Iterator[tuple[str, Weight]]:
    """Checkpoints that stack each layer's experts input side first (gpt-oss, Llama 4): ``mlp.experts.gate_up_proj``
    [E, H, 2I] (gate and up interleaved column by column, or gate's half first), ``down_proj`` [E, I, H] and the
    biases beside them, as one weight per expert under the names the modules use."""
    for name, tensor in weights:
        prefix, _, rest = name.partition(".mlp.experts.")
        if not rest or "." in rest:  # (already per expert)
            yield name, tensor
            continue
        if hasattr(tensor, "ggml_rows"):  # MXFP4 blocks kept as stored (runlm.models.prequantized.Mxfp4Stack)
            yield from _stacked_blocks(prefix, rest, tensor, interleaved)
            continue
        assert isinstance(tensor, torch.Tensor), name  # (3-D or 2-D: read dense)
        for e, w in enumerate(tensor):
            base = f"{prefix}.mlp.experts.{e}"
            if rest in ("gate_up_proj", "gate_up_proj_bias"):
                kind, w = ("bias", w) if rest.endswith("bias") else ("weight", w.T)
                gate, up = (w[0::2], w[1::2]) if interleaved else w.chunk(2)
                yield f"{base}.gate_proj.{kind}", gate
                yield f"{base}.up_proj.{kind}", up
            elif rest in ("down_proj", "down_proj_bias"):
                yield f"{base}.down_proj.{'bias' if rest.endswith('bias') else 'weight'}", w if w.ndim == 1 else w.T
            else:
                raise KeyError(f"unexpected weight {name!r}")


def _stacked_blocks(prefix: str, rest: str, stack: Any, interleaved: bool) -> Iterator[tuple[str, Weight]]:
    """An MXFP4 stack's experts as ggml blocks: its rows are the output side (gate and up's rows interleaved, or
    gate's half first), each a row of blocks along the input."""
    for e in range(stack.blocks.shape[0]):
        base = f"{prefix}.mlp.experts.{e}"
        if rest == "gate_up_proj":
            rows = stack.blocks.shape[1]
            gate, up = (slice(0, rows, 2), slice(1, rows, 2)) if interleaved else \
                (slice(0, rows // 2), slice(rows // 2, rows))
            yield f"{base}.gate_proj.weight", stack.ggml_rows(e, gate)
            yield f"{base}.up_proj.weight", stack.ggml_rows(e, up)
        elif rest == "down_proj":
            yield f"{base}.down_proj.weight", stack.ggml_rows(e, slice(None))
        else:
            raise KeyError(f"unexpected MXFP4 weight {prefix}.mlp.experts.{rest}")
