"""Native CPU kernels, compiled on first use (torch.utils.cpp_extension)."""
from runlm.kernels.attention import paged_attention
from runlm.kernels.linear import available, linear

__all__ = ["available", "linear", "paged_attention"]
