"""The native inference engine: continuous batching over a paged KV cache."""
