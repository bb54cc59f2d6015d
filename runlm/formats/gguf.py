"""GGUF model files: metadata, tensor index and vectorised dequantization.

The header is read by gguf_header (the file stays memory-mapped, read-only);
dequantization is our own whole-tensor numpy code following ggml's block layouts.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runlm.formats import ModelFormatError
from runlm.formats.architectures import DECODER_GGUF_ARCHS
from runlm.formats.ggml_types import BY_NAME
from runlm.formats.gguf_header import TensorInfo, read_model

if TYPE_CHECKING:  # torch is imported by the methods that return tensors: reading a file's metadata needs none
    import torch

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_TYPES", "TensorInfo", "GGUFFile", "dequantize", "ggml_type"]

SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(DECODER_GGUF_ARCHS) | {"bert"}

QK_K = 256


# --- dequantization -------------------------------------------------------------------------
# Each kernel takes the blocks as a structured array (one record per ggml block) and returns
# float32 of shape (n_blocks, block_elems). Fields are strided views: nothing is written.

def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)[:, None]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) packed bytes -> (n, 32) values: low nibbles first, then high (ggml's Q4/Q5 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) little-endian bytes of a uint32 -> (n, 32) bit k of it at position k, shifted to 0x10."""
    return np.unpackbits(qh, axis=1, bitorder="little") << 4


# The 32-value block types are affine: value = q * d (+ m) with a small integer q. Their parts
# (q as int8, d, m or None) are exposed so that a kernel can keep q in memory and compute the
# same floats itself (runlm.kernels.linear_q8); dequantizing goes through the same parts.
BlockParts = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]


def _parts_q4_0(b: np.ndarray) -> BlockParts:
    return _nibbles(b["qs"]).view(np.int8) - 8, _f16(b["d"]), None


def _parts_q4_1(b: np.ndarray) -> BlockParts:
    return _nibbles(b["qs"]).view(np.int8), _f16(b["d"]), _f16(b["m"])


def _parts_q5_0(b: np.ndarray) -> BlockParts:
    return (_nibbles(b["qs"]) | _high_bits(b["qh"])).view(np.int8) - 16, _f16(b["d"]), None


def _parts_q5_1(b: np.ndarray) -> BlockParts:
    return (_nibbles(b["qs"]) | _high_bits(b["qh"])).view(np.int8), _f16(b["d"]), _f16(b["m"])


def _parts_q8_0(b: np.ndarray) -> BlockParts:
    return b["qs"], _f16(b["d"]), None


def _affine(parts: Callable[[np.ndarray], BlockParts]) -> Callable[[np.ndarray], np.ndarray]:
    def kernel(b: np.ndarray) -> np.ndarray:
        q, d, m = parts(b)
        return q * d if m is None else q * d + m
    return kernel


_BLOCK_PARTS: dict[str, Callable[[np.ndarray], BlockParts]] = {
    "Q4_0": _parts_q4_0, "Q4_1": _parts_q4_1, "Q5_0": _parts_q5_0, "Q5_1": _parts_q5_1, "Q8_0": _parts_q8_0,
}
_q4_0, _q4_1, _q5_0, _q5_1, _q8_0 = (_affine(_BLOCK_PARTS[t]) for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"))


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 sub-block scales and mins of Q4_K/Q5_K (6-bit, packed in 12 bytes), times d and dmin."""
    s = b["scales"]
    s0, s1, s2 = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([s0 & 63, (s2 & 0x0F) | ((s0 >> 6) << 4)], axis=1)
    mn = np.concatenate([s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)], axis=1)
    return (_f16(b["d"]) * sc)[:, :, None], (_f16(b["dmin"]) * mn)[:, :, None]


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 128) -> (n, 8, 32): each 32-byte group gives sub-block 2j (low nibbles) and 2j+1 (high)."""
    q = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=2).reshape(-1, 8, 32)


def _q4_k(b: np.ndarray) -> np.ndarray:
    d, m = _k_scales(b)
    return (d * _k_nibbles(b["qs"]) - m).reshape(-1, QK_K)


_BITS8 = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
_SHIFT6 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def _q5_k(b: np.ndarray) -> np.ndarray:
    d, m = _k_scales(b)
    high = ((b["qh"][:, None, :] >> _BITS8) & 1) << 4  # sub-block s takes bit s of qh[l]
    return (d * (_k_nibbles(b["qs"]) | high) - m).reshape(-1, QK_K)


def _q6_k(b: np.ndarray) -> np.ndarray:
    ql = b["ql"].reshape(-1, 2, 2, 32)  # [half of the block, first/second 32 bytes, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # -> sub-rows k = 0..3 of 32 values
    high = ((b["qh"].reshape(-1, 2, 1, 32) >> _SHIFT6) & 3) << 4
    q = (low | high).view(np.int8) - 32
    ds = _f16(b["d"]) * b["scales"]  # one scale per 16 consecutive values
    return (ds[:, :, None] * q.reshape(-1, 16, 16)).reshape(-1, QK_K)


def _dt(*fields: tuple[Any, ...]) -> np.dtype:
    return np.dtype(list(fields))


_F16, _U8, _I8 = "<f2", "u1", "i1"
# qtype -> (values per block, block record layout, kernel)
_QUANTS: dict[str, tuple[int, np.dtype, Callable[[np.ndarray], np.ndarray]]] = {
    "Q4_0": (32, _dt(("d", _F16), ("qs", _U8, 16)), _q4_0),
    "Q4_1": (32, _dt(("d", _F16), ("m", _F16), ("qs", _U8, 16)), _q4_1),
    "Q5_0": (32, _dt(("d", _F16), ("qh", _U8, 4), ("qs", _U8, 16)), _q5_0),
    "Q5_1": (32, _dt(("d", _F16), ("m", _F16), ("qh", _U8, 4), ("qs", _U8, 16)), _q5_1),
    "Q8_0": (32, _dt(("d", _F16), ("qs", _I8, 32)), _q8_0),
    "Q4_K": (QK_K, _dt(("d", _F16), ("dmin", _F16), ("scales", _U8, 12), ("qs", _U8, 128)), _q4_k),
    "Q5_K": (QK_K, _dt(("d", _F16), ("dmin", _F16), ("scales", _U8, 12), ("qh", _U8, 32), ("qs", _U8, 128)),
             _q5_k),
    "Q6_K": (QK_K, _dt(("ql", _U8, 128), ("qh", _U8, 64), ("scales", _I8, 16), ("d", _F16)), _q6_k),
}
_FLOATS: dict[str, int] = {"F32": 4, "F16": 2, "BF16": 2}  # bytes per value

SUPPORTED_TYPES: frozenset[str] = frozenset(_QUANTS) | frozenset(_FLOATS)
# Dequantized by gguf-py (exact mode); fast mode computes on them as stored, like every other type.
_GGUF_PY_TYPES: frozenset[str] = frozenset({"Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4"})


def ggml_type(qtype: str) -> int:
    """ggml's enum value for a type name ("Q4_K" -> 12)."""
    return BY_NAME[qtype].value

# Dequantize about this many values at a time: bounds the size of the temporaries.
_CHUNK_VALUES = 1 << 20


def _nbytes(qtype: str, n_values: int) -> int:
    if qtype in _FLOATS:
        return n_values * _FLOATS[qtype]
    per_block, layout, _ = _QUANTS[qtype]
    return n_values // per_block * layout.itemsize


def dequantize(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Raw ggml bytes of type ``qtype`` -> a new float32 array of ``shape`` (never a view of ``data``)."""
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported tensor type {qtype} (supported: {', '.join(sorted(SUPPORTED_TYPES))})")
    n = int(np.prod(shape, dtype=np.int64))
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if qtype in _QUANTS and n % _QUANTS[qtype][0]:
        raise ValueError(f"{n} values is not a whole number of {qtype} blocks of {_QUANTS[qtype][0]}")
    if raw.nbytes != _nbytes(qtype, n):
        raise ValueError(f"{qtype} tensor of shape {shape} needs {_nbytes(qtype, n)} bytes, got {raw.nbytes}")
    if qtype == "F32":
        out = raw.view("<f4").astype(np.float32)
    elif qtype == "F16":
        out = raw.view("<f2").astype(np.float32)
    elif qtype == "BF16":
        out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        per_block, layout, kernel = _QUANTS[qtype]
        blocks = raw.view(layout)
        out = np.empty((blocks.shape[0], per_block), dtype=np.float32)
        step = _CHUNK_VALUES // per_block
        for i in range(0, blocks.shape[0], step):
            out[i:i + step] = kernel(blocks[i:i + step])
    return out.reshape(shape)


def block_parts(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw bytes of a 32-value block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) of 2-D ``shape`` [N, K] ->
    q int8 [N, K], d float32 [N, K/32], m float32 [N, K/32] (zeros for types without m), such that
    ``dequantize(...) == q * d[:, k // 32] + m[:, k // 32]`` bit for bit (multiply, then add)."""
    if qtype not in _BLOCK_PARTS or len(shape) != 2:
        raise ValueError(f"{qtype} tensor of shape {shape} is not a 2-D 32-value block type")
    n, k = shape
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.nbytes != _nbytes(qtype, n * k):
        raise ValueError(f"{qtype} tensor of shape {shape} needs {_nbytes(qtype, n * k)} bytes, got {raw.nbytes}")
    q, d, m = _BLOCK_PARTS[qtype](raw.view(_QUANTS[qtype][1]))
    d = d.reshape(n, k // 32).astype(np.float32)
    m = np.zeros_like(d) if m is None else m.reshape(n, k // 32).astype(np.float32)
    return np.ascontiguousarray(q.reshape(n, k), dtype=np.int8), d, m


# --- the file ------------------------------------------------------------------------------

def _why_unreadable(path: Path) -> str:
    with open(path, "rb") as fh:
        head = fh.read(4)
    if not head:
        return "the file is empty"
    if head != b"GGUF":
        return f"not a GGUF file (it starts with {head!r}, not b'GGUF')"
    size = path.stat().st_size
    return f"GGUF file is truncated or corrupt ({size} bytes; an interrupted download?)"


class GGUFFile:
    """A memory-mapped GGUF file: plain-python metadata, tensor index, raw and dequantized tensors."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._maps, self.metadata, self.tensors = read_model(self.path)
        except OSError:
            raise  # missing or unreadable file: not a format problem
        except (ValueError, IndexError, KeyError) as e:  # truncated or corrupt bytes
            raise ModelFormatError(f"{self.path}: {_why_unreadable(self.path)} ({type(e).__name__}: {e})") from e
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(f"{self.path}: metadata has no general.architecture string")
        self.architecture: str = arch

    @property
    def maps(self) -> list[np.ndarray]:
        """Each file of the model (one, or a split model's shards), mapped read-only (uint8)."""
        return self._maps

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, architecture={self.architecture!r}, tensors={len(self.tensors)})"

    def get(self, key: str, default: object = None) -> object:
        """Metadata value; a key starting with "." is taken relative to the architecture."""
        if key.startswith("."):
            key = self.architecture + key
        return self.metadata.get(key, default)

    def _info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.path}: no tensor named {name!r}")
        if info.offset + info.n_bytes > self._maps[info.part].nbytes:
            raise ModelFormatError(f"{self.path}: tensor {name!r} runs past the end of the file")
        return info

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file (no copy)."""
        info = self._info(name)
        return self._maps[info.part][info.offset:info.offset + info.n_bytes]

    def raw_array(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 numpy view [rows, row_bytes] of the mapped file: no
        copy, and pages shared with every process that maps the same file."""
        info = self._info(name)
        rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        return self.raw(name).reshape(rows, -1)

    def raw_tensor(self, name: str) -> torch.Tensor:
        """``raw_array`` as a torch view (no copy). Never written to."""
        import torch

        with warnings.catch_warnings():  # torch warns that the array is read-only; nothing writes it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self.raw_array(name))

    def load_array(self, name: str) -> np.ndarray:
        """The tensor dequantized into a new float32 numpy array, shaped ``TensorInfo.shape``."""
        info = self._info(name)
        if info.qtype not in SUPPORTED_TYPES and info.qtype not in _GGUF_PY_TYPES:
            raise ModelFormatError(f"{self.path}: tensor {name!r} has type {info.qtype}, which runlm cannot "
                                   f"dequantize (supported: {', '.join(sorted(SUPPORTED_TYPES | _GGUF_PY_TYPES))})")
        try:
            if info.qtype in SUPPORTED_TYPES:
                return dequantize(self.raw(name), info.qtype, info.shape)
            # the rarer block types: gguf-py's reference dequantizer (slower, same floats)
            import gguf  # (only here: gguf-py's imports are about 10 MB resident)

            values = gguf.quants.dequantize(self.raw(name), gguf.GGMLQuantizationType[info.qtype])
            return values.astype(np.float32, copy=False).reshape(info.shape)
        except ValueError as e:
            raise ModelFormatError(f"{self.path}: tensor {name!r}: {e}") from e

    def load(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor dequantized into a new torch tensor of ``dtype`` (default float32), shaped
        ``TensorInfo.shape``."""
        import torch

        return torch.from_numpy(self.load_array(name)).to(torch.float32 if dtype is None else dtype)

    def load_block_parts(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(q int8 [N, K], d, m fp32 [N, K/32]) of a 2-D tensor stored in a 32-value block type, else None.
        Dequantizing them (q * d + m, multiply then add) gives exactly ``load(name)``."""
        info = self._info(name)
        if info.qtype not in _BLOCK_PARTS or len(info.shape) != 2:
            return None
        import torch

        try:
            q, d, m = block_parts(self.raw(name), info.qtype, info.shape)
        except ValueError as e:
            raise ModelFormatError(f"{self.path}: tensor {name!r}: {e}") from e
        return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)

    def check_architecture(self) -> None:
        """Raise ModelFormatError unless runlm can build this file's architecture."""
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelFormatError(f"{self.path}: architecture {self.architecture!r} is not supported "
                                   f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
