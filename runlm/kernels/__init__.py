"""Native CPU kernels, compiled on first use (torch.utils.cpp_extension)."""
from runlm.kernels.attention import paged_attention
from runlm.kernels.linear import available, linear, linear_q8

__all__ = ["available", "linear", "linear_q8", "paged_attention"]
