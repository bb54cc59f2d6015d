"""The linear layer and token embedding every model uses, over whichever weights were loaded.

* fp32 weights: runlm's batch-invariant kernel (``runlm.kernels.linear``), torch elsewhere.
* Int8 blocks (exact mode, 32-value GGUF types): ``linear_q8`` dequantizes in registers to exactly
  the floats of the fp32 path, reading 1.25 bytes per weight instead of 4.
* GGUF blocks as stored (fast mode, every type ggml has a dot product for): ``GGMLWeight`` views of
  the memory-mapped file, computed on by ggml's integer dot products (``runlm.kernels.ggml``);
  no fp32 copy of the matrix ever exists.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from runlm.kernels import ggml, linear, linear_q8


class Adapter(Protocol):
    """What a layer's output passes through when adapters are attached (runlm.models.lora.LoRALayer)."""

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


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


@dataclass(slots=True)
class GGMLWeight:
    """A matrix [rows, cols] in a ggml block type: ``raw`` is uint8 [rows, row_bytes], usually a
    read-only view of the mapped GGUF file (so processes serving one file share its pages)."""
    raw: torch.Tensor
    qtype: int  # ggml type (gguf.GGMLQuantizationType value)
    rows: int
    cols: int

    def dense(self) -> torch.Tensor:
        return ggml.dequantize(self.raw, self.qtype, self.cols)


# What a loader hands load_weights for one checkpoint tensor.
Weight = torch.Tensor | BlockQuantized | GGMLWeight


class Linear(nn.Linear):
    # int8 blocks, buffers set together by keep_quantized (None until then)
    qweight: torch.Tensor | None
    scales: torch.Tensor | None
    offsets: torch.Tensor | None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name in ("qweight", "scales", "offsets"):  # set by keep_quantized
            self.register_buffer(name, None)
        self.ggml: list[GGMLWeight] = []  # set by keep_ggml
        # set by keep_device_blocks: GGUF blocks (GGMLWeight) or a pre-quantized checkpoint's matrices
        # (runlm.models.gpu_prequantized.DeviceQuantized), on the GPU runner's device
        self.device_blocks: list[Any] = []
        self.lora: Adapter | None = None  # set where LoRA adapters may be attached (runlm.models.lora)

    def reset_parameters(self) -> None:
        """No random init: every weight is loaded from a checkpoint (and init on "meta" costs seconds)."""

    def keep_quantized(self, q: Int8Parts) -> None:
        """Serve this layer from q's int8 values; the fp32 weight is dropped."""
        self.register_buffer("qweight", q.qweight.contiguous())
        self.register_buffer("scales", q.scales.contiguous())
        self.register_buffer("offsets", q.offsets.contiguous())
        self.register_parameter("weight", None)

    def keep_ggml(self, segments: list[GGMLWeight]) -> None:
        """Serve this layer from GGUF blocks as stored; outputs are the segments' rows in order."""
        self.ggml = segments
        self._ggml_raw = [s.raw for s in segments]
        self._ggml_types = [s.qtype for s in segments]
        self.register_parameter("weight", None)

    def keep_device_blocks(self, segments: list[Any], matmul: Callable[..., torch.Tensor]) -> None:
        """Serve this layer from matrices kept as stored on the GPU runner's device (GGUF blocks, a pre-quantized
        checkpoint's): ``matmul(x, segments=, bias=)`` (runlm.models.gpu_blocks.blocks_linear), outputs the
        segments' rows in order."""
        self.device_blocks = segments
        self._blocks_forward = functools.partial(matmul, segments=segments)
        self.register_parameter("weight", None)

    def direct_call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``forward`` with this layer's weights bound once: for loops that call it thousands of times."""
        if self.ggml:
            base = functools.partial(ggml.module().linear, weights=self._ggml_raw, types=self._ggml_types,
                                     bias=self.bias)
            lora = self.lora
            return base if lora is None else lambda x: lora.apply(x, base(x))
        return self.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base_forward(x)
        return y if self.lora is None else self.lora.apply(x, y)

    def _base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.device_blocks:
            return self._blocks_forward(x, bias=self.bias)
        if self.ggml:
            return ggml.linear(x, self._ggml_raw, self._ggml_types, self.bias)
        if self.qweight is not None:
            assert self.scales is not None and self.offsets is not None
            return linear_q8(x, self.qweight, self.scales, self.offsets, self.bias)
        return linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """Token embedding whose table may stay in a GGUF block type: rows are dequantized when gathered."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ggml: GGMLWeight | None = None
        self.device_blocks: GGMLWeight | None = None  # set by keep_device_blocks
        self.rows_dtype = torch.float32

    def reset_parameters(self) -> None:
        """No random init: the table is loaded from a checkpoint."""

    def keep_ggml(self, table: GGMLWeight) -> None:
        self.ggml = table
        self.register_parameter("weight", None)

    def keep_device_blocks(self, table: GGMLWeight, rows: Callable[[GGMLWeight, torch.Tensor], torch.Tensor],
                           dtype: torch.dtype) -> None:
        """Keep the table in its GGUF blocks on the GPU runner's device: ``rows(table, ids)`` dequantizes the rows
        gathered (runlm.models.gpu_blocks.dense_rows), then cast to ``dtype``."""
        self.device_blocks, self._rows, self.rows_dtype = table, rows, dtype
        self.register_parameter("weight", None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.device_blocks is not None:
            return self._rows(self.device_blocks, ids).to(self.rows_dtype)
        if self.ggml is not None:
            return ggml.embedding(ids, self.ggml.raw, self.ggml.qtype, self.ggml.cols)
        return super().forward(ids)
