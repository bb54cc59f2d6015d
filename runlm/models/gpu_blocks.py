"""GGUF blocks on the GPU runner's device: ggml's block types dequantized by torch (on whatever device holds them:
the loader's fallback and the reference the Triton kernel is held to), and a linear layer whose matrices stay in
their blocks as stored (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K): runlm.kernels.triton.ggml_matmul dequantizes them tile by
tile in registers where Triton runs (CUDA, or anywhere under TRITON_INTERPRET=1); elsewhere (the GPU runner on a CPU,
RUNLM_GPU_RUNNER=1) each call dequantizes the matrix with the torch code below: the same values either way."""
from __future__ import annotations

from collections.abc import Callable

import torch

from runlm.formats.ggml_types import BY_NAME, BY_VALUE
from runlm.kernels.triton import runs_on
from runlm.models.gpu_prequantized import DeviceQuantized
from runlm.models.linear import GGMLWeight


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from a [..., 2] uint8 tensor, as float32."""
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).float()
    return d[:, None] * q


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    qs = b[:, 2:].to(torch.int16)
    q = torch.cat([qs & 0xF, qs >> 4], dim=1).float() - 8.0
    return d[:, None] * q


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> [blocks, 8] each (ggml's get_scale_min_k4)."""
    s = scales.to(torch.int16)
    sc_lo, m_lo = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc_hi = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    m_hi = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([sc_lo, sc_hi], 1).float(), torch.cat([m_lo, m_hi], 1).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    qs = b[:, 16:144].to(torch.int16).view(-1, 4, 32)  # 4 chunks of 32 bytes: 64 values each
    q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32).float()  # sub-block j: 32 values
    return (d[:, None, None] * sc[:, :, None] * q - dmin[:, None, None] * m[:, :, None]).reshape(-1, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].to(torch.int16)
    qs = b[:, 48:176].to(torch.int16).view(-1, 4, 32)
    low = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32)
    high = torch.stack([(qh >> j) & 1 for j in range(8)], dim=1)  # sub-block j takes bit j of qh
    q = (low | (high << 4)).float()
    return (d[:, None, None] * sc[:, :, None] * q - dmin[:, None, None] * m[:, :, None]).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, 0:128].to(torch.int16).view(-1, 2, 64)
    qh = b[:, 128:192].to(torch.int16).view(-1, 2, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().view(-1, 2, 8)
    d = _f16(b[:, 208:210])
    lo0, lo1 = ql[:, :, :32], ql[:, :, 32:]
    q = torch.stack([(lo0 & 0xF) | ((qh & 3) << 4), (lo1 & 0xF) | (((qh >> 2) & 3) << 4),
                     (lo0 >> 4) | (((qh >> 4) & 3) << 4), (lo1 >> 4) | (((qh >> 6) & 3) << 4)], dim=2)
    q = q.float().view(-1, 2, 4, 2, 16) - 32.0  # half, quarter, 16-value group (scale index 2 * quarter + group)
    scale = sc.view(-1, 2, 4, 2)[..., None]
    return (d[:, None, None, None, None] * scale * q).reshape(-1, 256)


# qtype -> (values per block, bytes per block, dequantizer)
DEVICE_QUANTS: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    name: (BY_NAME[name].block, BY_NAME[name].type_size, fn)
    for name, fn in (("Q8_0", _q8_0), ("Q4_0", _q4_0), ("Q4_K", _q4_k), ("Q5_K", _q5_k), ("Q6_K", _q6_k))
}


def dequantize_on_device(raw: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """ggml bytes (uint8, on any device) of type ``qtype`` -> float32 of ``shape`` on the same device."""
    flat = raw.reshape(-1)
    if qtype == "F32":
        return flat.view(torch.float32).reshape(shape).clone()
    if qtype in ("F16", "BF16"):
        return flat.view(torch.float16 if qtype == "F16" else torch.bfloat16).float().reshape(shape)
    per_block, nbytes, fn = DEVICE_QUANTS[qtype]
    return fn(flat.view(-1, nbytes)).reshape(shape)


# the types a matrix may stay in on the device (ggml_matmul.BLOCKS: the Triton kernel reads each of them)
KEPT_TYPES = frozenset(DEVICE_QUANTS)


def dense(w: GGMLWeight) -> torch.Tensor:
    """A matrix in blocks as float32 [rows, cols], on the blocks' device."""
    return dequantize_on_device(w.raw, BY_VALUE[w.qtype].name, (w.rows, w.cols))


def dense_rows(w: GGMLWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of a table in blocks as float32 [*ids.shape, cols]."""
    rows = w.raw[ids.reshape(-1)]
    return dequantize_on_device(rows, BY_VALUE[w.qtype].name, (rows.shape[0], w.cols)).reshape(*ids.shape, w.cols)


def blocks_linear(x: torch.Tensor, segments: list[GGMLWeight] | list[DeviceQuantized],
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ concat(segments)^T (+ bias): each segment's rows, in order, as the output's columns. A segment is
    a GGUF matrix's blocks or a pre-quantized checkpoint's matrix (runlm.models.gpu_prequantized), each multiplied
    as stored by its Triton kernel where Triton runs, else dequantized by torch."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    n = sum(s.rows for s in segments)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    col = 0
    triton = runs_on(x.device.type)
    for s in segments:
        part = out[:, col:col + s.rows]
        if not triton:
            part.copy_(x2 @ (dense(s) if isinstance(s, GGMLWeight) else s.dense()).to(x.dtype).T)
        elif isinstance(s, GGMLWeight):
            from runlm.kernels.triton.ggml_matmul import ggml_matmul

            ggml_matmul(x2, s.raw, s.qtype, out=part)
        else:
            from runlm.kernels.triton.quant_matmul import quant_matmul

            quant_matmul(x2, s.kind, s.values, s.scales, s.zeros, s.groups, s.rows, s.cols, s.tile, out=part)
        col += s.rows
    if bias is not None:
        out += bias
    return out.reshape(*shape[:-1], n)
