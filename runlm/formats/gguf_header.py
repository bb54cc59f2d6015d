"""GGUF headers: metadata and the tensor index, read from the memory-mapped file. No torch here,
so the store can inspect a model without it.

Numeric arrays (token types, scores) are read with one ``np.frombuffer`` each; string arrays
(tokens, merges) in one tight loop over their lengths.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np


@dataclass(slots=True, frozen=True)
class TensorInfo:
    """Where a tensor lives in the file; ``shape`` is PyTorch order (ggml dims reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: str
    n_bytes: int
    offset: int

    @property
    def n_values(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


# GGUF value types -> numpy scalar types (8 = string and 9 = array are read apart)
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
            12: "<f8"}
_BOOL = 7


class _Cursor:
    """Reads a GGUF header from the mapped bytes: numeric arrays (token types, scores) in one
    ``np.frombuffer`` each; string arrays (tokens, merges) in one tight loop over their lengths."""

    def __init__(self, buf: np.ndarray) -> None:
        self.mem, self.pos = buf.data, 0

    def scalar(self, vtype: int) -> Any:
        dt = np.dtype(_SCALARS[vtype])
        value = np.frombuffer(self.mem, dt, 1, self.pos)[0].item()
        self.pos += dt.itemsize
        return bool(value) if vtype == _BOOL else value

    def string(self) -> str:
        n = self.scalar(10)
        text = bytes(self.mem[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype != 9:
            return self.scalar(vtype)
        item, count = self.scalar(4), self.scalar(10)
        if item in _SCALARS:
            dt = np.dtype(_SCALARS[item])
            values = np.frombuffer(self.mem, dt, count, self.pos)
            self.pos += dt.itemsize * count
            return [bool(v) for v in values] if item == _BOOL else values.tolist()
        if item == 8:
            mem, pos, out = self.mem, self.pos, [""] * count
            for i in range(count):
                n = int.from_bytes(mem[pos:pos + 8], "little")
                out[i] = str(mem[pos + 8:pos + 8 + n], "utf-8", "replace")
                pos += 8 + n
            self.pos = pos
            return out
        return [self.value(item) for _ in range(count)]  # arrays of arrays: rare and small


def _parse(buf: np.ndarray) -> tuple[dict[str, object], list[tuple[str, tuple[int, ...], int, int]], int]:
    """(metadata, [(name, ggml dims, ggml type, offset in the data section)], start of the data section)."""
    cur = _Cursor(buf)
    if bytes(cur.mem[:4]) != b"GGUF":
        raise ValueError("no GGUF magic")
    cur.pos = 4
    version = cur.scalar(4)
    if version & 0xFFFF == 0 and version >> 16 in (2, 3):
        raise ValueError("big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (runlm reads 2 and 3)")
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar(4))
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar(10) for _ in range(cur.scalar(4)))
        tensors.append((name, dims, cur.scalar(4), cur.scalar(10)))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int):
        raise ValueError(f"general.alignment {align!r} is not an integer")
    return metadata, tensors, (cur.pos + align - 1) // align * align


def read_header(path: str | os.PathLike) -> tuple[np.ndarray, dict[str, object], dict[str, TensorInfo]]:
    """(the file's bytes as a read-only mapping, metadata, tensors by name). Raises ValueError (or
    IndexError) on a truncated or corrupt file, OSError when it cannot be read."""
    try:
        data = np.memmap(Path(path), mode="r").view(np.ndarray)  # read-only, pages shared between processes
    except ValueError as e:  # numpy cannot map an empty file
        raise ValueError("the file is empty") from e
    metadata, entries, data_start = _parse(data)
    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, offset in entries:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name!r} has an unknown ggml type {type_id}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_values = int(np.prod(dims, dtype=np.int64))
        info = TensorInfo(name, tuple(reversed(dims)), qtype.name, n_values // block * type_size, data_start + offset)
        if info.offset + info.n_bytes > data.nbytes:
            raise ValueError(f"tensor {name!r} runs past the end of the file (needs bytes {info.offset}.."
                             f"{info.offset + info.n_bytes}, file has {data.nbytes}); truncated download?")
        tensors[name] = info
    return data, metadata, tensors
