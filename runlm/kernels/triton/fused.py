"""A decoder layer's small ops as one Triton launch each, for the GPU runner (where they were ~40% of a decode step's
launches on an H100): RMSNorm (torch: 7 launches in bf16), the residual add with the next RMSNorm (vLLM's
``fused_add_rms_norm``: 8), SiLU(gate) * up over the fused gate_up output (3), and the RoPE of q and k, alone or with
the K/V store into the paged cache (~15). One program per row (per token for RoPE); float32
inside, the torch path's roundings at its points: x normalized in float32 and rounded to x's dtype before the weight
multiplies it (runlm.models.llama.RMSNorm's formula), the sum x + y rounded before it is normalized, SiLU's result
rounded before the product (F.silu in x's dtype)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runlm.kernels.triton.kv_store import cache_value, is_fp8, kernel_view


@triton.jit
def _rms_norm_kernel(x_ptr, y_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_y, stride_out, stride_sum, n, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:  # the residual stream: x + y rounded to x's dtype (as torch adds), stored, then normalized
        y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + y.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    x2 = _rows(x)
    y2 = _rows(y) if y is not None else x2
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = torch.empty_like(x2) if y is not None else out
    n = x2.shape[1]
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, y2, weight, out, total, x2.stride(0), y2.stride(0), out.stride(0),
                                         total.stride(0), n, eps, ADD=y is not None, BLOCK=triton.next_power_of_2(n))
    return out.view(*x.shape[:-1], n), total.view(x.shape) if y is not None else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), over x's last dimension."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, rms_norm(x + y)) in one pass."""
    normed, total = _norm(x, y, weight, eps)
    assert total is not None
    return total, normed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, gate and up the two halves of gate_up's last dimension."""
    g2 = _rows(gate_up)
    n = g2.shape[1] // 2
    out = torch.empty(g2.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if g2.shape[0]:
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](g2, out, g2.stride(0), out.stride(0), n, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


@triton.jit
def _head_normed(x, w_ptr, at, inv):
    """RMSNorm's rounding (runlm.models.llama.RMSNorm) of x with its head's 1 / rms ``inv``, weights at ``at``."""
    w = tl.load(w_ptr + at).to(tl.float32)
    return (w * (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)).to(x.dtype)


@triton.jit
def _rotated(src, sh, h, d, mask, pos, cos_ptr, sin_ptr, stride_c, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
             w_ptr, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
    """Heads ``h`` [HP, 1] x features ``d`` [1, DP] at ``src`` rotated at ``pos``: x * cos + rotated * sin on the
    first ROTARY features (pairs, or halves), each product and the sum rounded to x's dtype as torch's three ops
    round them; the rest as they are. With NORM, each head first RMS-normalized (Qwen3's q/k norms: weights
    ``w_ptr`` [HEAD_DIM], as the norm's own launch would give them)."""
    rot = mask & (d < ROTARY)
    x = tl.load(src + h * sh + d, mask=mask, other=0.0)
    if INTERLEAVED:  # pairs (2i, 2i + 1): rotated = (-x[2i + 1], x[2i])
        partner = d ^ 1
        first = d % 2 == 0
    else:  # halves: rotated = (-x[half:], x[:half])
        partner = tl.where(d < ROTARY // 2, d + ROTARY // 2, d - ROTARY // 2)
        first = d < ROTARY // 2
    xp = tl.load(src + h * sh + partner, mask=rot, other=0.0)
    if NORM:
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]
        x = _head_normed(x, w_ptr, tl.where(d < HEAD_DIM, d, 0), inv)
        xp = _head_normed(xp, w_ptr, tl.where(rot, partner, 0), inv)
    xp = xp.to(tl.float32)
    xp = tl.where(first, -xp, xp)
    dt = x.dtype
    c = tl.load(cos_ptr + pos * stride_c + d, mask=d < ROTARY, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_c + d, mask=d < ROTARY, other=0.0).to(dt).to(tl.float32)
    y = ((x.to(tl.float32) * c).to(dt).to(tl.float32) + (xp * s).to(dt).to(tl.float32)).to(dt)
    return tl.where(rot, y, x)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_c,
                 HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_P: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_P)[None, :]
    h = tl.arange(0, HEADS_P)[:, None]
    if tl.program_id(1) == 0:
        mask = (h < HEADS) & (d < HEAD_DIM)
        y = _rotated(q_ptr + t * stride_qt, stride_qh, h, d, mask, pos, cos_ptr, sin_ptr, stride_c, ROTARY,
                     INTERLEAVED, q_ptr, 0.0, HEAD_DIM, False)
        tl.store(q_out_ptr + t * stride_qot + h * stride_qoh + d, y, mask=mask)
    else:
        mask = (h < KV_HEADS) & (d < HEAD_DIM)
        y = _rotated(k_ptr + t * stride_kt, stride_kh, h, d, mask, pos, cos_ptr, sin_ptr, stride_c, ROTARY,
                     INTERLEAVED, k_ptr, 0.0, HEAD_DIM, False)
        tl.store(k_out_ptr + t * stride_kot + h * stride_koh + d, y, mask=mask)


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, cos_ptr, sin_ptr, pos_ptr,
                       qw_ptr, kw_ptr, eps,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
                       stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_c,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HEAD_DIM_P: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr):
    """_rope_kernel, with the rotated K and V written into the paged caches at the token's slot (kv_store.py's
    layout; a slot below 0, a graph batch's padding row, writes nothing) instead of returned; with NORM, q's and k's
    heads RMS-normalized first (weights qw_ptr, kw_ptr: Qwen3's q/k norms, so they take no launches of their own)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_P)[None, :]
    h = tl.arange(0, HEADS_P)[:, None]
    which = tl.program_id(1)
    if which == 0:
        mask = (h < HEADS) & (d < HEAD_DIM)
        y = _rotated(q_ptr + t * stride_qt, stride_qh, h, d, mask, pos, cos_ptr, sin_ptr, stride_c, ROTARY,
                     INTERLEAVED, qw_ptr, eps, HEAD_DIM, NORM)
        tl.store(q_out_ptr + t * stride_qot + h * stride_qoh + d, y, mask=mask)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            block = slot // BLOCK_SIZE
            within = slot % BLOCK_SIZE
            mask = (h < KV_HEADS) & (d < HEAD_DIM)
            if which == 1:
                y = _rotated(k_ptr + t * stride_kt, stride_kh, h, d, mask, pos, cos_ptr, sin_ptr, stride_c, ROTARY,
                             INTERLEAVED, kw_ptr, eps, HEAD_DIM, NORM)
                tl.store(k_cache_ptr + block * stride_kcb + within * stride_kcs + h * stride_kch + d,
                         cache_value(y, k_cache_ptr, FP8), mask=mask)
            else:
                v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
                tl.store(v_cache_ptr + block * stride_vcb + within * stride_vcs + h * stride_vch + d,
                         cache_value(v, v_cache_ptr, FP8), mask=mask)


def _rope_shapes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> dict:
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rope needs each head's features and the tables' rows contiguous")
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    return dict(HEADS=heads, KV_HEADS=kv_heads, HEADS_P=triton.next_power_of_2(max(heads, kv_heads)),
                HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim), ROTARY=cos.shape[1])


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, KVH, D] (any token/head strides: views of a fused QKV output) rotated at ``positions``
    [T] by the tables' rows (cos, sin [>= max position + 1, R]: the first R features of each head rotate, in pairs
    or halves), into new tensors: one launch for both."""
    consts = _rope_shapes(q, k, cos, sin)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                   device=k.device)
    if q.shape[0]:
        _rope_kernel[(q.shape[0], 2)](q, k, q_out, k_out, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0),
                                      k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
                                      cos.stride(0), INTERLEAVED=interleaved, **consts)
    return q_out, k_out


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, interleaved: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor, norms: tuple[torch.Tensor, torch.Tensor, float] | None = None
               ) -> torch.Tensor:
    """``rope``'s rotation of q (returned) and k, with k and v stored into the caches [blocks, block_size, KVH, D]
    at ``slot_mapping`` (kv_store.store_kv's layout): the RoPE and the KV store of a layer in one launch. ``norms``
    (q's weights [D], k's, eps): each head of q and k RMS-normalized before the rotation, in the same launch."""
    consts = _rope_shapes(q, k, cos, sin)
    q_weight, k_weight, eps = norms if norms is not None else (q, k, 0.0)
    if v.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("rope_store needs a contiguous last (head_dim) dimension")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    fp8 = is_fp8(k_cache)
    k_cache, v_cache = kernel_view(k_cache), kernel_view(v_cache)
    if q.shape[0]:
        _rope_store_kernel[(q.shape[0], 3)](
            q, k, v, q_out, k_cache, v_cache, slot_mapping, cos, sin, positions, q_weight, k_weight, eps,
            q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), cos.stride(0), INTERLEAVED=interleaved, BLOCK_SIZE=k_cache.shape[1],
            NORM=norms is not None, FP8=fp8, **consts)
    return q_out
