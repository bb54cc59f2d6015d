"""The linear layer every model uses: runlm's batch-invariant kernels where they apply.

``runlm.kernels.linear`` reduces each output in one fixed order whatever the batch, so a
sequence's logits do not change with what else is in the step; anything the kernel does not
cover (another dtype or device, no compiler) runs torch's own ``F.linear``.

A layer loaded from a GGUF block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) can keep its weight
quantized: int8 values with a scale and offset per 32 (``BlockQuantized``), dequantized in
registers by ``linear_q8`` to exactly the floats the fp32 path would use. A decode step is
bound by reading the weights, and this reads 1.25 bytes per weight instead of 4.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runlm.kernels import linear, linear_q8


@dataclass(slots=True)
class BlockQuantized:
    """w[n, k] = qweight[n, k] * scales[n, k // 32] + offsets[n, k // 32]; ``dense`` is w itself."""
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor   # fp32 [N, K/32]
    offsets: torch.Tensor  # fp32 [N, K/32]
    dense: torch.Tensor    # fp32 [N, K]

    def int8_parts(self) -> Int8Parts:
        """The parts a layer keeps (dropping ``dense``, which is only needed while loading)."""
        return Int8Parts(self.qweight, self.scales, self.offsets)


@dataclass(slots=True)
class Int8Parts:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor   # fp32 [N, K/32]
    offsets: torch.Tensor  # fp32 [N, K/32]

    @staticmethod
    def cat(parts: list[Int8Parts]) -> Int8Parts:
        """Stack along N (rows), as fused projections stack their checkpoint tensors."""
        return Int8Parts(*(torch.cat([getattr(p, f) for p in parts]) for f in ("qweight", "scales", "offsets")))


class Linear(nn.Linear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name in ("qweight", "scales", "offsets"):  # set by keep_quantized
            self.register_buffer(name, None)

    def keep_quantized(self, q: Int8Parts) -> None:
        """Serve this layer from q's int8 values; the fp32 weight is dropped."""
        self.register_buffer("qweight", q.qweight.contiguous())
        self.register_buffer("scales", q.scales.contiguous())
        self.register_buffer("offsets", q.offsets.contiguous())
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return linear_q8(x, self.qweight, self.scales, self.offsets, self.bias)
        return linear(x, self.weight, self.bias)
