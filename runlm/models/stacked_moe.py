"""Mixtures of experts whose checkpoints stack each layer's experts input side first.

gpt-oss: Llama's layer with q/k/v/o biases, attention sinks (runlm.models.attention: a learned logit per head in
the softmax's denominator), sliding-window layers alternating with global ones, and a mixture of experts in every layer
(runlm.models.moe: a router with a bias, softmax over the chosen logits; experts with biases and the clamped SwiGLU of
runlm.models.llama.MLP). Its checkpoints stack each layer's experts, gate and up interleaved (runlm.models.moe.
stacked_experts); llama.cpp's files split them already. Its MXFP4 checkpoints' experts (``*_blocks``/``*_scales``) are
dequantized in exact mode and kept as ggml MXFP4 blocks in fast mode (runlm.models.prequantized.Mxfp4Stack)."""
from __future__ import annotations

from collections.abc import Iterable

from runlm.models.linear import Weight
from runlm.models.moe import MoeForCausalLM, stacked_experts


class GptOssForCausalLM(MoeForCausalLM):
    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
        return super().checkpoint_weights(stacked_experts(weights, interleaved=True))


class Llama4ForCausalLM(MoeForCausalLM):
    """Llama 4's text decoder (runlm.models.families.llama4_text): its stacked experts have gate's half first."""

    def checkpoint_weights(self, weights: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
        return super().checkpoint_weights(stacked_experts(weights, interleaved=False))
