"""ggml's tensor types: name -> (enum value, values per block, bytes per block).

The same table gguf-py ships (``gguf.GGMLQuantizationType``, ``gguf.GGML_QUANT_SIZES``;
tests/formats/test_ggml_types.py holds them equal), kept here so that reading a file's header does not
import gguf-py (with its yaml, tqdm and sentencepiece imports: about 10 MB resident in every engine).
"""
from __future__ import annotations

from typing import NamedTuple


class GGMLType(NamedTuple):
    name: str
    value: int
    block: int  # values per block
    type_size: int  # bytes per block


_TYPES = (
    ("F32", 0, 1, 4), ("F16", 1, 1, 2), ("Q4_0", 2, 32, 18), ("Q4_1", 3, 32, 20), ("Q5_0", 6, 32, 22),
    ("Q5_1", 7, 32, 24), ("Q8_0", 8, 32, 34), ("Q8_1", 9, 32, 40), ("Q2_K", 10, 256, 84), ("Q3_K", 11, 256, 110),
    ("Q4_K", 12, 256, 144), ("Q5_K", 13, 256, 176), ("Q6_K", 14, 256, 210), ("Q8_K", 15, 256, 292),
    ("IQ2_XXS", 16, 256, 66), ("IQ2_XS", 17, 256, 74), ("IQ3_XXS", 18, 256, 98), ("IQ1_S", 19, 256, 50),
    ("IQ4_NL", 20, 32, 18), ("IQ3_S", 21, 256, 110), ("IQ2_S", 22, 256, 82), ("IQ4_XS", 23, 256, 136),
    ("I8", 24, 1, 1), ("I16", 25, 1, 2), ("I32", 26, 1, 4), ("I64", 27, 1, 8), ("F64", 28, 1, 8),
    ("IQ1_M", 29, 256, 56), ("BF16", 30, 1, 2), ("TQ1_0", 34, 256, 54), ("TQ2_0", 35, 256, 66),
    ("MXFP4", 39, 32, 17), ("NVFP4", 40, 64, 36), ("Q1_0", 41, 128, 18),
)
BY_VALUE: dict[int, GGMLType] = {t[1]: GGMLType(*t) for t in _TYPES}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in BY_VALUE.values()}
