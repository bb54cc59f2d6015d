"""Pre-quantized checkpoints on the GPU runner's device, read as stored: 4-bit GPTQ (act-order included) and AWQ,
and FP8 (e4m3) with per-tensor, per-row or per-tile scales (runlm.models.prequantized names the formats). Each
matrix's bytes go to the device as the checkpoint stores them; one repacking there puts them in the layout of
runlm.kernels.triton.quant_matmul (4-bit values two a byte along each output row; scales and zeros per row and
group; FP8 bits as they are), which dequantizes them tile by tile in registers. Where Triton does not run (the GPU
runner on a CPU) each call dequantizes the matrix with ``dense`` -- the same values as the CPU runners' reading."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from runlm.models import prequantized

INT4, FP8 = 0, 1  # (runlm.kernels.triton.quant_matmul's kinds)


@dataclass(slots=True)
class DeviceQuantized:
    """One pre-quantized matrix [rows, cols] on the device in the kernel's layout (quant_matmul's docstring)."""
    kind: int
    values: torch.Tensor            # int4: uint8 [rows, ceil(cols / 2)]; fp8: uint8 [rows, cols]
    scales: torch.Tensor            # float32: int4 [rows, groups]; fp8 [ceil(rows / tile[0]), ceil(cols / tile[1])]
    zeros: torch.Tensor | None      # int4: float32 [rows, groups]
    groups: torch.Tensor | None     # int4: int32 [cols], each input column's group
    rows: int
    cols: int
    tile: tuple[int, int] = (1, 1)  # fp8: the rows x columns one scale covers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.scales, self.zeros, self.groups)
                   if t is not None)

    def dense(self) -> torch.Tensor:
        """float32 [rows, cols] on the values' device."""
        if self.kind == INT4:
            assert self.zeros is not None and self.groups is not None
            q = torch.stack((self.values & 0xF, self.values >> 4), dim=-1).reshape(self.rows, -1)[:, :self.cols]
            g = self.groups.long()
            return (q.float() - self.zeros[:, g]) * self.scales[:, g]
        return prequantized.dequantize_fp8(self.values.view(torch.float8_e4m3fn).float(), self.scales,
                                           list(self.tile))


def from_int4(method: str, config: Mapping[str, Any], qweight: torch.Tensor, qzeros: torch.Tensor,
              scales: torch.Tensor, g_idx: torch.Tensor | None) -> DeviceQuantized:
    """A GPTQ or AWQ module's tensors (prequantized.unpack_int4 reads their packing), on any device -> the kernel's
    layout there."""
    q, zeros, scales, groups = prequantized.unpack_int4(method, config, qweight, qzeros, scales, g_idx)
    q = q.T.to(torch.uint8)  # [N, K]
    n, k = q.shape
    if k % 2:
        q = torch.cat((q, q.new_zeros(n, 1)), dim=1)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return DeviceQuantized(INT4, packed, scales.T.contiguous(), zeros.float().T.contiguous(),
                           groups.int().contiguous(), n, k)


def from_fp8(values: torch.Tensor, scale: torch.Tensor, block: list[int] | None) -> DeviceQuantized:
    """An FP8 matrix (e4m3) and its scale: one, one per output row, or one per ``block`` (rows x cols) tile."""
    rows, cols = values.shape
    if values.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weights in {values.dtype} are not read on the GPU (e4m3 are)")
    grid, tile = prequantized.scale_tiles(rows, cols, scale, block)
    return DeviceQuantized(FP8, values.contiguous().view(torch.uint8), grid.contiguous(), None, None, rows, cols,
                           tile)


def device_prequantized(weights: Iterator[tuple[str, torch.Tensor]], hf_config: Mapping[str, Any] | None
                        ) -> Iterator[tuple[str, torch.Tensor | DeviceQuantized]]:
    """A checkpoint's tensors (on the device, as stored) with each pre-quantized module's parts gathered into one
    DeviceQuantized ``<module>.weight``; everything else passes through."""
    int4, block = prequantized.int4_method(hf_config), prequantized.block_size(hf_config)
    held: dict[str, torch.Tensor] = {}  # (a module's parts, until the last one is read)
    fp8: list[str] = []
    for name, tensor in weights:
        if name.endswith(prequantized.SKIPPED_SUFFIXES):
            continue
        if (int4 is not None and name.endswith(prequantized.INT4_SUFFIXES)) or \
                name.endswith(prequantized.SCALE_SUFFIXES):
            held[name] = tensor
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            held[name] = tensor
            fp8.append(name)
        else:
            yield name, tensor
    for name in fp8:
        scale = prequantized.scale_name(name, held)
        if scale is None:
            raise ValueError(f"FP8 weight {name!r} has no scale beside it")
        yield name, from_fp8(held.pop(name), held.pop(scale), block)
    if int4 is not None:
        for name in [n for n in held if n.endswith(".qweight")]:
            base = name[:-len("qweight")]
            yield base + "weight", from_int4(int4[0], int4[1], held.pop(name), held.pop(base + "qzeros"),
                                             held.pop(base + "scales"), held.pop(base + "g_idx", None))
    if held:
        raise ValueError(f"quantization tensors without their weight: {sorted(held)[:3]}")
