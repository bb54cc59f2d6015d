"""y = x @ W^T with W a pre-quantized checkpoint's matrix as stored (runlm.models.gpu_prequantized.DeviceQuantized):
4-bit GPTQ/AWQ or FP8 (e4m3), dequantized in registers tile by tile, never whole in memory -- the GPU runner's
linear layer on the checkpoints vLLM users bring (a 4-bit matrix reads ~4x fewer bytes than its bf16 copy).

Layouts (made once at load from the checkpoint's packing, the bytes kept):
- int4: ``values`` uint8 [N, ceil(K / 2)] (input column k of row n in byte k // 2, the low nibble first);
  ``scales`` and ``zeros`` float32 [N, G]; ``groups`` int32 [K]: each input column's group (GPTQ's act-order
  ``g_idx``, or k // group_size). w = (q - zeros[n, g]) * scales[n, g], as runlm.models.prequantized computes it.
- fp8: ``values`` uint8 [N, K] (e4m3 bits); ``scales`` float32 [ceil(N / BR), ceil(K / BC)], one per BR x BC tile
  (per tensor: one tile; per output row: BR = 1, BC = K). w = e4m3(bits) * scale.

A program computes a [BLOCK_M, BLOCK_N] tile of y over K in steps of 32 (columns past K masked): x's [BLOCK_M, 32]
tile, the [BLOCK_N, 32] weights decoded in float32 (bit for bit the torch dequantizers' values), cast to x's dtype,
``tl.dot`` with float32 accumulation (IEEE for float32 inputs)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runlm.kernels.triton.fp8 import e4m3_value
from runlm.kernels.triton.ggml_matmul import BLOCK_N, dot_add, store_tile, tile_rows, tiles

INT4, FP8 = 0, 1


@triton.jit
def _quant_matmul_kernel(x_ptr, v_ptr, s_ptr, z_ptr, g_ptr, y_ptr, M, N, K, stride_xm, stride_vn, stride_sn,
                         stride_ym, BR, BC, KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr):
    rows_m, mask_m = tile_rows(0, BLOCK_M, M)
    rows_n, mask_n = tile_rows(1, BLOCK_N, N)
    safe_n = tl.where(mask_n, rows_n, 0).to(tl.int64)
    cols = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 32):
        k = k0 + cols
        k_ok = k < K
        x = tl.load(x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=mask_m[:, None] & k_ok[None, :], other=0.0)
        m = mask_n[:, None] & k_ok[None, :]
        if KIND == 0:  # int4: a nibble, its group's scale and zero
            byte = tl.load(v_ptr + safe_n[:, None] * stride_vn + (k // 2)[None, :], mask=m, other=0).to(tl.int32)
            q = ((byte >> ((k % 2) * 4)[None, :]) & 0xF).to(tl.float32)
            g = tl.load(g_ptr + k, mask=k_ok, other=0)
            at = safe_n[:, None] * stride_sn + g[None, :]
            w = (q - tl.load(z_ptr + at, mask=m, other=0.0)) * tl.load(s_ptr + at, mask=m, other=0.0)
        else:  # fp8: e4m3 times its tile's scale
            bits = tl.load(v_ptr + safe_n[:, None] * stride_vn + k[None, :], mask=m, other=0)
            scale = tl.load(s_ptr + (safe_n // BR)[:, None] * stride_sn + (k // BC)[None, :], mask=m, other=0.0)
            w = e4m3_value(bits) * scale
        acc = dot_add(acc, x, tl.where(m, w, 0.0).to(x.dtype), IEEE)
    store_tile(y_ptr, acc, rows_m, mask_m, rows_n, mask_n, stride_ym)


def quant_matmul(x: torch.Tensor, kind: int, values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 groups: torch.Tensor | None, n: int, k: int, tile: tuple[int, int] = (1, 1),
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ W^T for W [n, k] in ``kind`` (INT4 or FP8, the module docstring's layouts;
    ``tile``: FP8's scale tile, rows x columns); into ``out`` [M, n] (a column slice of a wider output is fine) or
    a new tensor of x's dtype."""
    m = x.shape[0]
    if x.shape[1] != k or x.stride(1) != 1 or values.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError(f"quant_matmul: x {tuple(x.shape)} for a [{n}, {k}] weight, every last dim contiguous")
    int4 = kind == INT4
    if int4 and (zeros is None or groups is None or zeros.stride() != scales.stride()):
        raise ValueError("quant_matmul: an int4 weight needs zeros laid out as its scales, and its groups")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m and n:
        block_m, grid = tiles(m, n)
        _quant_matmul_kernel[grid](x, values, scales, zeros if int4 else scales, groups if int4 else scales, out, m,
                                   n, k, x.stride(0), values.stride(0), scales.stride(0), out.stride(0), tile[0],
                                   tile[1], KIND=kind, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                                   IEEE=x.dtype == torch.float32)
    return out
