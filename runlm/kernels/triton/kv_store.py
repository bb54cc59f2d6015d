"""The step's new K/V into the paged cache by slot mapping, one Triton launch per layer (after nano-vllm's
``store_kvcache``): token t's K/V [KVH, D] go to block ``slot // block_size``, offset ``slot % block_size``, of
caches [num_blocks, block_size, KVH, D]; a slot below 0 (a padding row of a CUDA-graph batch) writes nothing.
One program per token stores K and V for all KV heads, converted to the cache's dtype (an fp8 cache -- vLLM's
``--kv-cache-dtype fp8``, e4m3 with a scale of 1 -- as its bits: runlm.kernels.triton.fp8, torch's rounding)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runlm.kernels.triton.fp8 import e4m3_bits


@triton.jit
def cache_value(x, ptr, FP8: tl.constexpr):
    """x as it goes into a cache at ``ptr``: its e4m3 bits where the cache is fp8 (seen as uint8), else cast."""
    if FP8:
        return e4m3_bits(x)
    return x.to(ptr.dtype.element_ty)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """A cache as the kernels take it: an fp8 cache as its bytes (they encode and decode e4m3 themselves)."""
    return cache.view(torch.uint8) if is_fp8(cache) else cache


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    within = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + within * stride_kcs + heads * stride_kch + dims,
             cache_value(k, k_cache_ptr, FP8), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + within * stride_vcs + heads * stride_vch + dims,
             cache_value(v, v_cache_ptr, FP8), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, KVH, D] (any row/head strides, D contiguous: slices of a fused QKV projection are fine) into the
    caches at ``slot_mapping`` [>= T] (int32 or int64, on the device)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("store_kv needs a contiguous last (head_dim) dimension")
    fp8 = is_fp8(k_cache)
    k_cache, v_cache = kernel_view(k_cache), kernel_view(v_cache)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], FP8=fp8,
    )
