"""Native CPU kernels, compiled on first use (torch.utils.cpp_extension)."""
from runlm.kernels.attention import available as attention_available
from runlm.kernels.attention import paged_attention
from runlm.kernels.linear import available, linear, linear_q8

__all__ = ["attention_available", "available", "linear", "linear_q8", "paged_attention"]
