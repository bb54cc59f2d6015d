"""The KV cache's size per token: one formula for the engine (which allocates it) and the store and
runner (which estimate memory from a model's header before loading it). Kept free of torch so the
CLI's start-up does not import it."""
from __future__ import annotations


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    """A K and a V vector per layer and KV head."""
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_value
