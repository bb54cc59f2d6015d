"""Runs one scheduled batch of pooling requests: flatten, forward, pool, finish each vector.

Every sequence's whole prompt is in the batch (the scheduler never splits a pooling prompt), so
nothing is cached between steps: the forward context is ``ForwardContext.no_cache`` and the
encoder attends within each sequence (both ways for BERT, causally for a decoder) -- on CUDA (or under
TRITON_INTERPRET=1) through the GPU runner's Triton attention kernel, one launch a layer for the whole batch
(runlm.kernels.triton.backend.VarlenAttention); the batch's ids, positions and lengths go up once, the pooled
vectors come down in one copy, nothing per sequence.
"""
from __future__ import annotations

import torch

from runlm.engine.core.sequence import Sequence
from runlm.engine.types.pooling_params import PoolingParams
from runlm.kernels.triton.backend import VarlenAttention, use_triton_on
from runlm.models.attention import ForwardContext, forward_context
from runlm.models.pooling import finish_embedding
from runlm.models.pooling_models import LoadedPoolingModel


def apply_activation(logits: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    return logits


class PoolingRunner:
    def __init__(self, loaded: LoadedPoolingModel, device: torch.device) -> None:
        self.loaded, self.device = loaded, device
        self.use_triton = use_triton_on(device)

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], token_type_ids: list[list[int] | None]) -> list[torch.Tensor]:
        """One finished vector (on the CPU, float32) per sequence, in order."""
        lens = [s.num_tokens for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.token_ids], device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        types = None
        if any(t is not None for t in token_type_ids):
            types = torch.tensor([x for s, t in zip(seqs, token_type_ids) for x in (t or [0] * s.num_tokens)],
                                 device=self.device)
        model = self.loaded.model
        ctx = ForwardContext.no_cache(lens)
        if self.use_triton:  # (one launch a layer for the whole batch; else SDPA per sequence or length group)
            ctx.backend = VarlenAttention(lens, self.device, causal=model.causal)
        with forward_context(ctx):
            hidden = model(ids, positions, types)
            pooled = model.pooled(hidden, lens).cpu()
        return [self._finish(vec, s.pooling_params) for vec, s in zip(pooled, seqs)]  # type: ignore[arg-type]

    def _finish(self, vec: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if self.loaded.num_labels == 0:
            normalize = self.loaded.pooler.normalize if params.normalize is None else params.normalize
            return finish_embedding(vec, normalize, params.dimensions)
        return apply_activation(vec, self.loaded.activation)
