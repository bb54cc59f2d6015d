"""A mixture of experts' weights arranged for the GPU runner's fused kernel (runlm.kernels.triton.fused_moe): each
layer's experts stacked per projection, [E, N, K] in the model's dtype or, for a GGUF kept in blocks, the ggml rows
[E, N, row_bytes] as stored. The experts keep working one by one (the host path: CPUs without Triton, the reference)
because their weights become views of the stacks: no second copy.

Stacked are the experts the kernel computes: gated SiLU MLPs without biases or gpt-oss's clamp, the router's weights
applied to the outputs (not Llama 4's inputs), each projection dense in every expert or in one block type. Any other
layer says why not (SparseMoeBlock.unstacked) and keeps its host path, and the GPU runner then runs without CUDA
graphs, naming the reason."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from runlm.formats.ggml_types import BY_VALUE
from runlm.models.gpu_blocks import blocks_linear
from runlm.models.linear import GGMLWeight, Linear
from runlm.models.llama import MLP
from runlm.models.moe import SparseMoeBlock, StackedExperts

log = logging.getLogger("runlm.gpu")


def stack_model_experts(model: nn.Module, first_layer: int = 0) -> None:
    """Stack every mixture-of-experts layer of a model loaded onto the GPU runner's device (see the docstring),
    from decoder layer ``first_layer`` on (those before it: a layer offload's, on the host)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    scope = model if layers is None else nn.ModuleList(list(layers)[first_layer:])
    blocks = [m for m in scope.modules() if isinstance(m, SparseMoeBlock)]
    reasons = [reason for block in blocks if (reason := stack_experts(block)) is not None]
    if blocks:
        log.info("mixture of experts: %d of %d layers stacked for the fused kernel%s", len(blocks) - len(reasons),
                 len(blocks), f" (the rest on the host: {reasons[0]})" if reasons else "")


def stack_experts(block: SparseMoeBlock) -> str | None:
    """Set ``block.stacked`` (the experts' weights become views of it); else ``block.unstacked`` = why not, returned."""
    experts = [e for e in block.experts if isinstance(e, MLP) and e.act is F.silu and e.limit is None]
    if block.weight_input:
        reason = "the router's weights scale the experts' inputs"
    elif len(experts) != len(block.experts):
        reason = "its experts are not gated SiLU MLPs"
    else:
        gate_up = _stack([e.gate_up_proj for e in experts])
        down = _stack([e.down_proj for e in experts])
        if isinstance(gate_up, tuple) and isinstance(down, tuple):
            block.stacked = StackedExperts(gate_up[0], gate_up[1], down[0], down[1])
            return None
        reason = gate_up if isinstance(gate_up, str) else str(down)
    block.unstacked = reason
    return reason


def _stack(linears: list[Linear]) -> tuple[torch.Tensor, int] | str:
    """One projection of every expert stacked, each expert's weight rebound as a view of the stack; or why not."""
    if any(lin.bias is not None for lin in linears):
        return "its experts have biases"
    if any(not isinstance(s, GGMLWeight) for lin in linears for s in lin.device_blocks):
        return "its experts are a pre-quantized checkpoint's (GPTQ/AWQ/FP8)"
    if all(lin.device_blocks for lin in linears):
        types = {s.qtype for lin in linears for s in lin.device_blocks}
        if len(types) != 1:
            return f"its experts mix block types ({', '.join(sorted(BY_VALUE[t].name for t in types))})"
        (qtype,) = types
        stack = torch.stack([torch.cat([s.raw for s in lin.device_blocks]) for lin in linears])
        for lin, raw in zip(linears, stack):
            segments, row = [], 0
            for s in lin.device_blocks:
                segments.append(GGMLWeight(raw[row:row + s.rows], s.qtype, s.rows, s.cols))
                row += s.rows
            lin.keep_device_blocks(segments, blocks_linear)
        return stack, qtype
    if any(lin.device_blocks or lin.weight is None for lin in linears):
        return "its experts mix blocks and dense weights"
    stack = torch.stack([lin.weight.data for lin in linears])
    for lin, weight in zip(linears, stack):
        lin.weight = nn.Parameter(weight, requires_grad=False)
    return stack, 0
