"""y = x @ W^T with W in a GGUF block type as stored (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K): the GPU runner's linear layer
on a GGUF model's blocks, dequantized in registers tile by tile, never whole in memory (llama.cpp's and Ollama's
reason to run GGUF on a GPU: a Q4_K_M matrix reads ~3.5x fewer bytes than its bf16 copy).

W is uint8 [N, row_bytes] (ggml's rows, blocks side by side). A program computes a [BLOCK_M, BLOCK_N] tile of y: for
each 32 values of K it loads x's [BLOCK_M, 32] tile and the [BLOCK_N, 32] weights, decoded from their bytes exactly
as ggml dequantizes them (``d * q`` or ``d * scale * q - dmin * min`` in float32), cast to x's dtype, and adds
their product (``tl.dot``, float32 accumulation). The values are those of runlm.models.gpu_blocks' torch
dequantizers (the reference the tests hold this kernel to, under TRITON_INTERPRET=1 on the CPU).

Each 32-value step lies inside one block (Q8_0/Q4_0) or one 32-value sub-block of a superblock (the K-quants:
one scale and min per row for the whole step), so a step reads each row's scale bytes once."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runlm.formats.ggml_types import BY_NAME, BY_VALUE

# the types the kernel reads (their ggml values: the QTYPE branches below), with their block sizes
BLOCKS = {BY_NAME[name].value: (BY_NAME[name].block, BY_NAME[name].type_size)
          for name in ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")}


@triton.jit
def _f16_at(ptr):
    """The little-endian fp16 at ptr (byte pointers), as float32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k4_scale_min(sb_ptr, j):
    """Q4_K/Q5_K: sub-block j's 6-bit scale and min (ggml's get_scale_min_k4), from the 12 bytes at sb_ptr + 4."""
    s = sb_ptr + 4
    low = j < 4
    a = tl.load(s + tl.where(low, j, j + 4)).to(tl.int32)       # scales[j] or scales[j + 4]
    b = tl.load(s + tl.where(low, j + 4, j - 4)).to(tl.int32)   # scales[j + 4] or scales[j - 4]
    c = tl.load(s + j).to(tl.int32)                              # scales[j]
    sc = tl.where(low, a & 63, (a & 0xF) | ((b >> 6) << 4))
    mn = tl.where(low, b & 63, (a >> 4) | ((c >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _weights(w_ptr, rows, row_mask, k0, row_bytes, QTYPE: tl.constexpr):
    """The weights of rows ``rows`` [BN] at values k0 .. k0 + 31 as float32 [BN, 32]."""
    v = tl.arange(0, 32)[None, :]
    row = w_ptr + rows.to(tl.int64)[:, None] * row_bytes
    m = row_mask[:, None]
    if QTYPE == 8:  # Q8_0: d (fp16), 32 x int8
        blk = row + (k0 // 32) * 34
        d = _f16_at(blk)
        q = tl.load(blk + 2 + v, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return d * q
    elif QTYPE == 2:  # Q4_0: d, 16 bytes of nibbles (values 0-15 low, 16-31 high), value - 8
        blk = row + (k0 // 32) * 18
        d = _f16_at(blk)
        byte = tl.load(blk + 2 + (v % 16), mask=m, other=0).to(tl.int32)
        q = ((byte >> ((v // 16) * 4)) & 0xF).to(tl.float32) - 8.0
        return d * q
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: superblocks of 256, 8 sub-blocks of 32 with a scale and min
        SB: tl.constexpr = 144 if QTYPE == 12 else 176
        QS: tl.constexpr = 16 if QTYPE == 12 else 48
        sb = row + (k0 // 256) * SB
        j = (k0 % 256) // 32                   # the sub-block
        chunk = j // 2                         # 64 values per 32 bytes of qs: low nibbles, then high
        d = _f16_at(sb)
        dmin = _f16_at(sb + 2)
        sc, mn = _k4_scale_min(sb, j)
        byte = tl.load(sb + QS + 32 * chunk + v, mask=m, other=0).to(tl.int32)
        q = (byte >> ((j % 2) * 4)) & 0xF
        if QTYPE == 13:  # the fifth bit: bit j of qh[v]
            qh = tl.load(sb + 16 + v, mask=m, other=0).to(tl.int32)
            q = q | (((qh >> j) & 1) << 4)
        return d * sc * q.to(tl.float32) - dmin * mn
    else:  # Q6_K: ql[128], qh[64], scales[16] (int8), d; halves of 128 values, quarters of 32
        sb = row + (k0 // 256) * 210
        r = k0 % 256
        h = r // 128
        quarter = (r % 128) // 32
        d = _f16_at(sb + 208)
        low = tl.load(sb + 64 * h + 32 * (quarter % 2) + v, mask=m, other=0).to(tl.int32)
        low = (low >> ((quarter // 2) * 4)) & 0xF
        high = (tl.load(sb + 128 + 32 * h + v, mask=m, other=0).to(tl.int32) >> (2 * quarter)) & 3
        scale = tl.load(sb + 192 + 8 * h + 2 * quarter + v // 16, mask=m, other=0).to(tl.int8, bitcast=True)
        return d * scale.to(tl.float32) * ((low | (high << 4)).to(tl.float32) - 32.0)


@triton.jit
def _ggml_matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, row_bytes, stride_ym,
                        QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    rows_m, mask_m = tile_rows(0, BLOCK_M, M)
    rows_n, mask_n = tile_rows(1, BLOCK_N, N)
    cols = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 32):
        x = tl.load(x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm + k0 + cols[None, :], mask=mask_m[:, None],
                    other=0.0)
        w = _weights(w_ptr, tl.where(mask_n, rows_n, 0), mask_n, k0, row_bytes, QTYPE).to(x.dtype)
        acc = dot_add(acc, x, w, IEEE)
    store_tile(y_ptr, acc, rows_m, mask_m, rows_n, mask_n, stride_ym)


@triton.jit
def tile_rows(axis: tl.constexpr, BLOCK: tl.constexpr, limit):
    """This program's BLOCK rows along grid axis ``axis`` and which of them are < limit."""
    rows = tl.program_id(axis) * BLOCK + tl.arange(0, BLOCK)
    return rows, rows < limit


@triton.jit
def dot_add(acc, x, w, IEEE: tl.constexpr):
    """acc + x @ w^T (x [BM, 32], w [BN, 32] in x's dtype; IEEE: float32 without TF32)."""
    if IEEE:
        return acc + tl.dot(x, tl.trans(w), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w))


@triton.jit
def store_tile(y_ptr, acc, rows_m, mask_m, rows_n, mask_n, stride_ym):
    y = y_ptr + rows_m.to(tl.int64)[:, None] * stride_ym + rows_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def ggml_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32/bf16/fp16, rows contiguous) @ W^T, W = ``raw`` (uint8 [N, row_bytes]) in ggml type
    ``qtype``; into ``out`` [M, N] (a column slice of a wider output is fine) or a new tensor of x's dtype."""
    per_block, nbytes = BLOCKS[qtype]
    m, k = x.shape
    n, row_bytes = raw.shape
    if k % per_block or row_bytes != k // per_block * nbytes:
        raise ValueError(f"{BY_VALUE[qtype].name}: rows of {row_bytes} bytes do not hold K={k} values")
    if x.stride(1) != 1 or raw.stride(1) != 1 or raw.stride(0) != row_bytes:
        raise ValueError("ggml_matmul needs x's rows and the weight's bytes contiguous")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m and n:
        block_m, grid = tiles(m, n)
        _ggml_matmul_kernel[grid](x, raw, out, m, n, k, x.stride(0), row_bytes, out.stride(0), QTYPE=qtype,
                                  BLOCK_M=block_m, BLOCK_N=BLOCK_N, IEEE=x.dtype == torch.float32)
    return out


BLOCK_N = 64  # weight rows a program takes


def tiles(m: int, n: int) -> tuple[int, tuple[int, int]]:
    """(BLOCK_M, grid) of a dequantize-in-kernel matmul of m rows by n weight rows: 16 rows a program for decode
    steps, up to 64 for prefill."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
