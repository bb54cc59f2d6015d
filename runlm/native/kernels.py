"""runlm's CPU kernels over numpy arrays, through ctypes: the torch extensions' own code (the same bits)
in a library that needs no torch (runlm/kernels/csrc/native_abi.cpp, built by runlm.native.build).

Arrays are C-contiguous and of the stated dtype (checked here, ValueError otherwise); outputs are
preallocated and passed as ``out``, and returned for convenience. Types are ggml's enum values
(``gguf.GGMLQuantizationType``). Every result is independent of the thread count and of the other
rows of a batch, as in the torch build. ``available()`` never raises; the other functions raise
RuntimeError when the library is unavailable.
"""
from __future__ import annotations

import numpy as np

from runlm.native.decoder import Decoder, DecoderLayer, LayerFamily
from runlm.native.library import F32, I64, U8, arr, available, check_shape, lib, ok, optional_f32, ptr, vector
from runlm.native.linear_weights import LinearWeights

__all__ = ["Decoder", "DecoderLayer", "LayerFamily", "LinearWeights", "add_rms_norm", "available", "block_size",
           "cpu_features", "dequantize", "embedding", "gelu_tanh_mul", "get_threads", "linear", "paged_attention",
           "qkv_rope_store", "rms_norm", "row_bytes", "set_threads", "silu_mul", "supported"]


def cpu_features() -> str:
    """The SIMD features ggml's CPU backend uses ("" where the library is unavailable)."""
    return lib().runlm_cpu_features().decode() if available() else ""


def set_threads(n: int) -> None:
    """Threads every kernel uses from now on, whichever thread calls (n <= 0: OpenMP's default)."""
    lib().runlm_set_threads(int(n))


def get_threads() -> int:
    return int(lib().runlm_get_threads())


def supported(qtype: int) -> bool:
    """Whether ggml has a CPU dot product for weights of this type (and the library is here)."""
    return available() and bool(lib().runlm_supported(int(qtype)))


def row_bytes(qtype: int, cols: int) -> int:
    return int(lib().runlm_row_bytes(int(qtype), int(cols)))


def block_size(qtype: int) -> int:
    """Values per block of this type (32, or 256 for the K-quants; 1 for F32/F16/BF16)."""
    return int(lib().runlm_block_size(int(qtype)))


def linear(x: np.ndarray, w: LinearWeights, out: np.ndarray) -> np.ndarray:
    """out [M, N] = x [M, K] @ w^T (+ bias): ggml's activation quantization and runlm's block kernels."""
    xp, op = arr(x, F32, "x", 2), arr(out, F32, "out", 2)
    m = x.shape[0]
    if x.shape[1] != w.cols or out.shape != (m, w.rows):
        raise ValueError(f"linear: x {x.shape} and out {out.shape} do not fit weights [{w.rows}, {w.cols}]")
    lib().runlm_linear(w.handle, xp, m, op)
    return out


def embedding(ids: np.ndarray, table: np.ndarray, qtype: int, dim: int, out: np.ndarray) -> np.ndarray:
    """out [T, dim] = rows ``ids`` of a raw [V, row_bytes] table of ggml type qtype, dequantized."""
    ip, tp, op = arr(ids, I64, "ids", 1), arr(table, U8, "table", 2), arr(out, F32, "out", 2)
    check_shape("out", out.shape, (ids.shape[0], dim))
    ok(lib().runlm_embedding(ip, ids.shape[0], tp, table.shape[0], table.shape[1], int(qtype), dim, op))
    return out


def dequantize(table: np.ndarray, qtype: int, dim: int) -> np.ndarray:
    """A raw [N, row_bytes] table of ggml type qtype as a new fp32 [N, dim] array."""
    tp = arr(table, U8, "table", 2)
    out = np.empty((table.shape[0], dim), dtype=np.float32)
    ok(lib().runlm_dequantize(tp, table.shape[0], table.shape[1], int(qtype), dim, ptr(out)))
    return out


def _rows(x: np.ndarray, name: str) -> tuple[int, int]:
    """(rows, width) of an fp32 array whose last dimension is the row."""
    n = x.shape[-1] if x.ndim else 0
    return (x.size // n if n else 0), n


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> np.ndarray:
    """out = x / rms(x) * w, row by row (out may be x)."""
    xp, op = arr(x, F32, "x"), arr(out, F32, "out")
    rows, n = _rows(x, "x")
    check_shape("out", out.shape, x.shape)
    lib().runlm_rms_norm(xp, vector(w, "weight", n), op, rows, n, eps)
    return out


def add_rms_norm(x: np.ndarray, residual: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> np.ndarray:
    """residual += x (in place); out = rms_norm(residual, w)."""
    xp, rp, op = arr(x, F32, "x"), arr(residual, F32, "residual"), arr(out, F32, "out")
    rows, n = _rows(x, "x")
    check_shape("residual", residual.shape, x.shape)
    check_shape("out", out.shape, x.shape)
    lib().runlm_add_rms_norm(xp, rp, vector(w, "weight", n), op, rows, n, eps)
    return out


def _gated(fn_name: str, gate_up: np.ndarray, out: np.ndarray) -> np.ndarray:
    gp, op = arr(gate_up, F32, "gate_up"), arr(out, F32, "out")
    rows, two_i = _rows(gate_up, "gate_up")
    if two_i % 2:
        raise ValueError("gate_up must have an even number of columns")
    check_shape("out", out.shape, (*gate_up.shape[:-1], two_i // 2))
    getattr(lib(), fn_name)(gp, op, rows, two_i // 2)
    return out


def silu_mul(gate_up: np.ndarray, out: np.ndarray) -> np.ndarray:
    """[M, 2I] -> out [M, I] = silu(gate) * up."""
    return _gated("runlm_silu_mul", gate_up, out)


def gelu_tanh_mul(gate_up: np.ndarray, out: np.ndarray) -> np.ndarray:
    """[M, 2I] -> out [M, I] = gelu_tanh(gate) * up."""
    return _gated("runlm_gelu_tanh_mul", gate_up, out)


def _caches(k_cache: np.ndarray, v_cache: np.ndarray, kv_heads: int | None, head_dim: int | None) -> tuple[int, int]:
    kp, vp = arr(k_cache, F32, "k_cache", 3), arr(v_cache, F32, "v_cache", 3)
    check_shape("v_cache", v_cache.shape, k_cache.shape)
    if kv_heads is not None:
        check_shape("k_cache", k_cache.shape, (k_cache.shape[0], kv_heads, head_dim or 0))
    return kp, vp


def qkv_rope_store(qkv: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, k_cache: np.ndarray,
                   v_cache: np.ndarray, slot_mapping: np.ndarray, heads: int, kv_heads: int, head_dim: int,
                   interleaved: bool, q_norm: np.ndarray | None, k_norm: np.ndarray | None, eps: float,
                   q_out: np.ndarray) -> np.ndarray:
    """Splits qkv [T, (H + 2 KVH) D] rows, RMS-normalizes q and k per head (where norms are given),
    rotates them (RoPE tables [L, D]), writes K/V to their cache slots [S, KVH, D]; q_out [T, H, D]."""
    t, d = qkv.shape[0] if qkv.ndim == 2 else -1, head_dim
    qp = arr(qkv, F32, "qkv", 2)
    check_shape("qkv", qkv.shape, (t, (heads + 2 * kv_heads) * d))
    pp, sp = arr(positions, I64, "positions", 1), arr(slot_mapping, I64, "slot_mapping", 1)
    check_shape("positions", positions.shape, (t,))
    check_shape("slot_mapping", slot_mapping.shape, (t,))
    cp, snp = arr(cos, F32, "cos", 2), arr(sin, F32, "sin", 2)
    check_shape("cos", cos.shape, (cos.shape[0], d))
    check_shape("sin", sin.shape, cos.shape)
    kp, vp = _caches(k_cache, v_cache, kv_heads, d)
    op = arr(q_out, F32, "q_out", 3)
    check_shape("q_out", q_out.shape, (t, heads, d))
    ok(lib().runlm_qkv_rope_store(qp, pp, cp, snp, cos.shape[0], kp, vp, k_cache.shape[0], sp, t, heads,
                                       kv_heads, d, int(interleaved), optional_f32(q_norm, "q_norm", d),
                                       optional_f32(k_norm, "k_norm", d), eps, op))
    return q_out


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, flat_slots: np.ndarray,
                    query_lens: np.ndarray, context_lens: np.ndarray, scale: float, window: int | None,
                    softcap: float | None, out: np.ndarray) -> bool:
    """Causal attention of q [T, H, D] (every sequence's rows in batch order) over the paged caches
    [S, KVH, D]: sequence b's rows are its last query_lens[b] of context_lens[b] positions, whose K/V
    slots are flat_slots[sum(context_lens[:b]) : ...]. Writes out [T, H, D]; False where the kernel
    does not cover the input (out untouched)."""
    qp = arr(q, F32, "q", 3)
    t, h, d = q.shape
    kp, vp = _caches(k_cache, v_cache, None, None)
    if k_cache.shape[2] != d:
        raise ValueError("runlm attention: head shapes do not match")
    fp = arr(flat_slots, I64, "flat_slots", 1)
    qlp, clp = arr(query_lens, I64, "query_lens", 1), arr(context_lens, I64, "context_lens", 1)
    check_shape("context_lens", context_lens.shape, query_lens.shape)
    op = arr(out, F32, "out", 3)
    check_shape("out", out.shape, q.shape)
    code = lib().runlm_paged_attention(qp, kp, vp, k_cache.shape[0], fp, flat_slots.shape[0], qlp, clp,
                                           query_lens.shape[0], t, h, k_cache.shape[1], d, scale, window or 0,
                                           softcap or 0.0, op)
    ok(code)
    return code == 0
