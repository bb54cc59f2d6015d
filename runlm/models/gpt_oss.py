"""gpt-oss: Llama's layer with q/k/v/o biases, attention sinks (runlm.models.attention: a learned logit per head in
the softmax's denominator), sliding-window layers alternating with global ones, and a mixture of experts in every layer
(runlm.models.moe: a router with a bias, softmax over the chosen logits; experts with biases and the clamped SwiGLU of
runlm.models.llama.MLP). Its checkpoints stack each layer's experts with the input side first: ``gate_up_proj``
[E, H, 2I] (gate and up interleaved column by column), ``down_proj`` [E, I, H], biases beside; they are split per
expert here (llama.cpp's files split them already)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from runlm.models.linear import Weight
from runlm.models.moe import MoeForCausalLM


class GptOssForCausalLM(MoeForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        super().load_weights(_per_expert(weights))


def _per_expert(weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    for name, tensor in weights:
        prefix, _, rest = name.partition(".mlp.experts.")
        if not rest or "." in rest:  # (already per expert)
            yield name, tensor
            continue
        assert isinstance(tensor, torch.Tensor), name  # (3-D or 2-D: read dense)
        for e, w in enumerate(tensor):
            base = f"{prefix}.mlp.experts.{e}"
            if rest == "gate_up_proj":
                yield f"{base}.gate_proj.weight", w.T[0::2]
                yield f"{base}.up_proj.weight", w.T[1::2]
            elif rest == "gate_up_proj_bias":
                yield f"{base}.gate_proj.bias", w[0::2]
                yield f"{base}.up_proj.bias", w[1::2]
            elif rest == "down_proj":
                yield f"{base}.down_proj.weight", w.T
            elif rest == "down_proj_bias":
                yield f"{base}.down_proj.bias", w
            else:
                raise KeyError(f"unexpected weight {name!r} (gpt-oss's MXFP4 checkpoints are read from GGUF files)")
