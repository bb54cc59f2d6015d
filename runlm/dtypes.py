"""Compute dtypes by name or as torch.dtype, read without importing torch where a name will do.

A config holds the common names as strings (so building one needs no torch); the torch runner turns
them into a torch.dtype with ``torch_dtype`` when it allocates."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_BYTES", "dtype_itemsize", "torch_dtype"]

# the names a config keeps as they are, with their bytes per element
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A dtype or its name (such as "bfloat16") as a torch.dtype; imports torch."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype must be a torch dtype or its name (such as 'bfloat16'), not {dtype!r}")
    return found


def dtype_itemsize(dtype: torch.dtype | str) -> int:
    """Bytes per element (the KV-cache budget); no torch needed for the names in DTYPE_BYTES."""
    return DTYPE_BYTES[dtype] if isinstance(dtype, str) and dtype in DTYPE_BYTES else torch_dtype(dtype).itemsize
