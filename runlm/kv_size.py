"""The KV cache's size per token: one formula for the engine (which allocates it) and the store and
runner (which estimate memory from a model's header before loading it). Kept free of torch so the
CLI's start-up does not import it."""
from __future__ import annotations


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_value: int,
                       v_dim: int | None = None) -> int:
    """A K and a V vector per layer and KV head (V ``v_dim`` wide where it differs: 0 for a latent-attention cache,
    whose one "head" is a K row holding the latent)."""
    return num_layers * num_kv_heads * (head_dim + (head_dim if v_dim is None else v_dim)) * bytes_per_value


# --kv-cache-dtype (vLLM's name): "auto" lets the runner choose (the native runner fp16, llama.cpp's and Ollama's
# default; the torch and GPU runners the compute dtype); "fp32" and "fp16" name the native runner's, "q8_0"
# stores the cache in llama.cpp's q8_0 blocks, 34 bytes (an fp16 scale and 32 int8) per 32 values, and "fp8" (the
# GPU runner's) in float8 e4m3, a byte a value (vLLM's fp8 cache, a scale of 1).
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "q8_0", "fp8")
NATIVE_AUTO = "fp16"  # what "auto" is on the native (CPU) runner
Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34


def check_kv_cache_dtype(value: str) -> str:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {value!r}")
    return value


def q8_row_bytes(head_dim: int) -> int:
    """One KV head's row of head_dim values in q8_0 blocks (head_dim a multiple of 32)."""
    return head_dim // Q8_BLOCK * Q8_BLOCK_BYTES


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                             bytes_per_value: int = 4, v_dim: int | None = None) -> int:
    """kv_bytes_per_token for a cache of kv_cache_dtype ("auto": bytes_per_value per value)."""
    kind = check_kv_cache_dtype(kv_cache_dtype)
    if kind == "q8_0":
        if head_dim % Q8_BLOCK:
            raise ValueError(f"a q8_0 KV cache needs head_dim a multiple of 32, not {head_dim}")
        return 2 * num_layers * num_kv_heads * q8_row_bytes(head_dim)
    size = {"fp16": 2, "fp32": 4, "fp8": 1}.get(kind, bytes_per_value)
    return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, size, v_dim)
