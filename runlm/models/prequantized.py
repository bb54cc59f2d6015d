"""Pre-quantized checkpoints, as vLLM users bring them: FP8 (e4m3) with scales, DeepSeek-V3's and Qwen3's ``fp8``
(``weight_scale_inv`` per 128x128 block, ``quantization_config.weight_block_size``) and compressed-tensors'
float-quantized (``weight_scale`` per tensor or per output channel); and 4-bit GPTQ (act-order ``g_idx``, v1 and v2
zeros) and AWQ (GEMM packing), groups of any size. Each matrix is what the checkpoint defines it as (FP8 value times
scale; scale * (q - zero)); exact mode computes on that, and fast mode repacks it once to GGUF's Q8_0 blocks (a scale
per 32 values: the nearest type that holds an act-order GPTQ's scattered groups too), the bytes logged. A repack into
Q4_1 (4-bit, exact for groups in order) is not done."""
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


def scale_tiles(rows: int, cols: int, scale: torch.Tensor, block: list[int] | None
                ) -> tuple[torch.Tensor, tuple[int, int]]:
    """An FP8 matrix's scale as a float32 grid of tiles and the tile's rows x cols: one scalar (the whole matrix),
    one per output row, or one per ``block`` tile (the config's, else as the grid divides the matrix)."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1), (rows, cols)
    if scale.numel() == rows:
        return scale.reshape(rows, 1), (1, cols)
    br, bc = block or [math.ceil(rows / scale.shape[0]), math.ceil(cols / scale.shape[-1])]
    if scale.shape != (math.ceil(rows / br), math.ceil(cols / bc)):
        raise ValueError(f"a scale of shape {tuple(scale.shape)} fits neither the tensor nor {br}x{bc} blocks")
    return scale, (br, bc)


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    """FP8 values (already widened to float32) times their scale (scale_tiles' three kinds)."""
    rows, cols = values.shape
    grid, (br, bc) = scale_tiles(rows, cols, scale, block)
    if (br, bc) == (rows, cols):
        return values * grid.reshape(())
    if (br, bc) == (1, cols):
        return values * grid
    return values * grid.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


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
            logger.info("%s: %d pre-quantized matrices repacked to Q8_0 (%.1f MiB)", directory, self.matrices,
                        self.bytes / 2**20)


# --- 4-bit integer checkpoints: GPTQ and AWQ -----------------------------------------------------------------------
# ``<module>.qweight`` (int32, eight 4-bit values each), ``qzeros`` (int32, packed alike), ``scales`` (fp16, per group
# of input rows and output column), GPTQ's ``g_idx`` (each input row's group). A weight is scale * (q - zero).
INT4_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
_AWQ_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # AWQ packs output columns 0 2 4 6 1 3 5 7 into a word's nibbles


def int4_method(hf_config: Mapping[str, Any] | None) -> tuple[str, Mapping[str, Any]] | None:
    """("gptq" or "awq", the quantization config) for a 4-bit checkpoint; None for any other."""
    q = (hf_config or {}).get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        return None
    if int(q.get("bits", q.get("w_bit", 4))) != 4:
        raise ValueError(f"{method} checkpoints of {q.get('bits', q.get('w_bit'))} bits are not supported (4 are)")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ's {q.get('version')} packing is not supported (GEMM's is)")
    return method, q


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values, lowest first, along ``dim`` (0: rows, 1: columns)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]
    if dim == 0:
        return values.permute(0, 2, 1).reshape(-1, packed.shape[1])
    return values.reshape(packed.shape[0], -1)


def unpack_int4(method: str, config: Mapping[str, Any], qweight: torch.Tensor, qzeros: torch.Tensor,
                scales: torch.Tensor, g_idx: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GPTQ or AWQ module's tensors unpacked on their device: (q [in, out], zeros [groups, out] (GPTQ v1's
    stored-less-one put right), scales [groups, out] float32, each input row's group [in] int64). The weight is
    (q - zeros[group]) * scales[group]."""
    scales = scales.float()
    if method == "gptq":  # qweight [in / 8, out]: packed along the input rows
        q = _nibbles(qweight, 0)
        zeros = _nibbles(qzeros, 1)
        if str(config.get("checkpoint_format", "gptq")).lower() != "gptq_v2":
            zeros = zeros + 1  # GPTQ's v1 files store each zero less one
        in_features = q.shape[0]
        size = int(config.get("group_size", 128))
        groups = g_idx.long() if g_idx is not None else \
            torch.arange(in_features, device=q.device) // (size if size > 0 else in_features)
    else:  # AWQ: qweight [in, out / 8], packed along the output columns in its own order
        order = torch.tensor(_AWQ_ORDER, device=qweight.device)
        q = _nibbles(qweight, 1).view(qweight.shape[0], -1, 8)[..., order].reshape(qweight.shape[0], -1)
        zeros = _nibbles(qzeros, 1).view(qzeros.shape[0], -1, 8)[..., order].reshape(qzeros.shape[0], -1)
        in_features = q.shape[0]
        groups = torch.arange(in_features, device=q.device) // (in_features // scales.shape[0])
    return q, zeros, scales, groups


def dequantize_int4(method: str, config: Mapping[str, Any], qweight: torch.Tensor, qzeros: torch.Tensor,
                    scales: torch.Tensor, g_idx: torch.Tensor | None) -> torch.Tensor:
    """The [out, in] float32 weight of a GPTQ or AWQ module."""
    q, zeros, scales, groups = unpack_int4(method, config, qweight, qzeros, scales, g_idx)
    w = (q.float() - zeros[groups].float()) * scales[groups]  # [in, out]
    return w.T.contiguous()


# --- MXFP4 stacks: gpt-oss's Hugging Face checkpoints ---------------------------------------------------------------
# ``<name>_blocks`` [E, rows, cols / 32, 16] (two e2m1 values a byte, the first in the low nibble) and ``<name>_scales``
# [E, rows, cols / 32] (e8m0: a power of two, biased by 127). ggml's MXFP4 block is the same scale byte and 16 bytes
# whose low nibbles are values 0-15 and high nibbles 16-31, its values doubled (its scale read halved).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Mxfp4Stack:
    """A stacked expert tensor stored as MXFP4: dequantized ([E, cols, rows], the dense checkpoint's input-side-first
    layout), or each expert's rows as ggml MXFP4 blocks (as stored: fast mode computes on them)."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
            raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match their scales {tuple(scales.shape)}")
        self.blocks, self.scales = blocks, scales

    def dense(self) -> torch.Tensor:
        lut = torch.tensor(FP4_VALUES)
        low, high = lut[(self.blocks & 0x0F).long()], lut[(self.blocks >> 4).long()]
        values = torch.stack((low, high), dim=-1).flatten(-2)  # [E, rows, groups, 32]
        values = torch.ldexp(values, self.scales.to(torch.int32)[..., None] - 127)
        return values.flatten(-2).transpose(1, 2).contiguous()

    def ggml_rows(self, expert: int, rows: slice) -> Any:
        """Expert ``expert``'s ``rows`` as a GGMLWeight of MXFP4 blocks."""
        from runlm.formats.gguf import ggml_type
        from runlm.models.linear import GGMLWeight

        b, s = self.blocks[expert, rows], self.scales[expert, rows]  # [n, groups, 16], [n, groups]
        pairs = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)  # the 32 values' nibbles in order
        qs = pairs[..., :16] | (pairs[..., 16:] << 4)  # ggml's order
        raw = torch.cat((s[..., None], qs), dim=-1).reshape(b.shape[0], -1).contiguous()
        return GGMLWeight(raw, ggml_type("MXFP4"), b.shape[0], b.shape[1] * 32)
