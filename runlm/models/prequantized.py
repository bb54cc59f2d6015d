"""Checkpoints whose matrices are stored in FP8 (e4m3) with scales, as vLLM users bring them: DeepSeek-V3's and
Qwen3's ``fp8`` (``weight_scale_inv`` per 128x128 block, ``quantization_config.weight_block_size``) and
compressed-tensors' float-quantized (``weight_scale`` per tensor or per output channel). Each such matrix is its FP8
values times its scale (the checkpoint's own definition); exact mode computes on that, and fast mode repacks it once
to GGUF's Q8_0 blocks (an 8-bit format like the stored one: a scale per 32 values), the bytes logged."""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")  # (a weight's own scale beside it)
SKIPPED_SUFFIXES = ("input_scale",)  # compressed-tensors' static activation scales: runlm quantizes activations itself


def scale_name(weight: str, names: Mapping[str, Any]) -> str | None:
    """The scale tensor beside an FP8 ``<module>.weight`` (None: it has none)."""
    base = weight[:-len("weight")]
    return next((base + s for s in SCALE_SUFFIXES if base + s in names), None)


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    """FP8 values (already widened to float32) times their scale: one scalar, one per output row, or one per
    ``block`` (rows x cols) tile."""
    rows, cols = values.shape
    scale = scale.float()
    if scale.numel() == 1:
        return values * scale.reshape(())
    if scale.numel() == rows:
        return values * scale.reshape(rows, 1)
    br, bc = block or [math.ceil(rows / scale.shape[0]), math.ceil(cols / scale.shape[-1])]
    if scale.shape != (math.ceil(rows / br), math.ceil(cols / bc)):
        raise ValueError(f"a scale of shape {tuple(scale.shape)} fits neither the tensor nor {br}x{bc} blocks")
    return values * scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def block_size(hf_config: Mapping[str, Any] | None) -> list[int] | None:
    q = (hf_config or {}).get("quantization_config") or {}
    size = q.get("weight_block_size")
    return [int(size[0]), int(size[1])] if isinstance(size, list) and len(size) == 2 else None


class Q8Repacker:
    """Fast mode: dense matrices written once as Q8_0 blocks (ggml's quantizer), their bytes counted for the log."""

    def __init__(self) -> None:
        self.matrices = self.bytes = 0

    def repack(self, dense: torch.Tensor) -> Any:
        from runlm.formats.gguf import ggml_type
        from runlm.models.linear import GGMLWeight
        from runlm.quantize import ggml_ops

        rows, cols = dense.shape
        qtype = ggml_type("Q8_0")
        out = np.empty((rows, ggml_ops.row_size(qtype, cols)), dtype=np.uint8)
        ggml_ops.quantize_rows(qtype, np.ascontiguousarray(dense.numpy(), dtype=np.float32), out, None)
        self.matrices, self.bytes = self.matrices + 1, self.bytes + out.nbytes
        return GGMLWeight(torch.from_numpy(out), qtype, rows, cols)

    def log(self, directory: object) -> None:
        if self.matrices:
            logger.info("%s: %d FP8 matrices repacked to Q8_0 (%.1f MiB)", directory, self.matrices,
                        self.bytes / 2**20)
