"""Qwen3-Next: the hybrid layers (runlm.models.hybrid) with gated DeltaNet mixers (runlm.models.gated_delta) on three
layers of four and gated attention (ModelConfig.attn_output_gate, per-head q/k norms, RoPE on a quarter of each head)
on the rest, Qwen2-MoE's experts with a gated shared expert; its RMSNorms are 1 + w (the DeltaNet's gated norms
excepted)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from runlm.models.config import ModelConfig
from runlm.models.gemma import offset_norms
from runlm.models.hybrid import HybridForCausalLM
from runlm.models.linear import GGMLWeight, Weight


class Qwen3NextForCausalLM(HybridForCausalLM):
    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
        weights = _split_qkvz(weights, self.config)
        return offset_norms(weights, self.config.norm_offset, plain=".linear_attn.norm.weight")


def _split_qkvz(weights: Iterable[tuple[str, Weight]], cfg: ModelConfig) -> Iterator[tuple[str, Weight]]:
    """HF's ``in_proj_qkvz`` (per key head: its query, key, values, gates) as llama.cpp stores it: ``in_proj_qkv``
    (every query row, then every key row, then every value row) and ``in_proj_z`` -- rows regrouped, dense or as the
    file's half-precision rows."""
    values = cfg.ssm_heads // cfg.ssm_groups * cfg.ssm_state  # a key head's values (and gates)
    sizes = [cfg.ssm_head_dim, cfg.ssm_head_dim, values, values]
    for name, w in weights:
        if not name.endswith(".in_proj_qkvz.weight"):
            yield name, w
            continue
        rows = w.raw if isinstance(w, GGMLWeight) else w
        assert isinstance(rows, torch.Tensor), name
        q, k, v, z = rows.reshape(cfg.ssm_groups, sum(sizes), -1).split(sizes, dim=1)
        qkv, gate = torch.cat([p.reshape(-1, rows.shape[-1]) for p in (q, k, v)]), z.reshape(-1, rows.shape[-1])
        base = name.removesuffix("in_proj_qkvz.weight")
        for part, value in (("in_proj_qkv", qkv), ("in_proj_z", gate)):
            yield f"{base}{part}.weight", GGMLWeight(value.contiguous(), w.qtype, value.shape[0], w.cols) \
                if isinstance(w, GGMLWeight) else value
