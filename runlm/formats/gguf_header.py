"""GGUF headers: metadata and the tensor index, read from the memory-mapped file. No torch here,
so the store can inspect a model without it.

Numeric arrays (token types, scores) are read with one ``np.frombuffer`` each; string arrays
(tokens, merges) in one tight loop over their lengths.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runlm.formats.ggml_types import BY_VALUE


@dataclass(slots=True, frozen=True)
class TensorInfo:
    """Where a tensor lives in the file; ``shape`` is PyTorch order (ggml dims reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: str
    n_bytes: int
    offset: int
    part: int = 0  # which file of a split model holds it (read_model)

    @property
    def n_values(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


# GGUF value types -> numpy scalar types (8 = string and 9 = array are read apart)
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
            12: "<f8"}
_BOOL = 7
_MAX_DIMS = 4          # GGML_MAX_DIMS
_MAX_NESTING = 4       # arrays of arrays of ...: real files use none; a deep chain is a RecursionError
_MIN_KV = 8 + 4 + 1    # the smallest key/value pair: an empty key, its type, a one-byte value
_MIN_TENSOR = 8 + 4 + 4 + 8  # the smallest tensor info: an empty name, no dims, its type and offset


class GGUFHeaderError(ValueError):
    """A header field that cannot be what it says (a count or length past the end of the file). The message
    names the field, never a value read from the file."""


class _Cursor:
    """Reads a GGUF header from the mapped bytes: numeric arrays (token types, scores) in one
    ``np.frombuffer`` each; string arrays (tokens, merges) in one tight loop over their lengths.
    Every count and length is checked against the bytes that remain before anything is allocated."""

    def __init__(self, buf: np.ndarray) -> None:
        self.mem, self.pos = buf.data, 0
        self.size = len(self.mem)

    def need(self, n: int, field: str) -> None:
        if n > self.size - self.pos:
            raise GGUFHeaderError(f"GGUF header: {field} runs past the end of the file "
                                  f"({self.size - self.pos} bytes remain at offset {self.pos})")

    def scalar(self, vtype: int, field: str = "a value") -> Any:
        dt = np.dtype(_SCALARS[vtype])
        self.need(dt.itemsize, field)
        value = np.frombuffer(self.mem, dt, 1, self.pos)[0].item()
        self.pos += dt.itemsize
        return bool(value) if vtype == _BOOL else value

    def count(self, field: str, item_size: int) -> int:
        """A u64 count of items of at least ``item_size`` bytes each, which the rest of the file must hold."""
        n = self.scalar(10, field)
        if n * item_size > self.size - self.pos:
            raise GGUFHeaderError(f"GGUF header: {field} declares more than the {self.size - self.pos} bytes "
                                  f"left in the file can hold")
        return n

    def string(self, field: str = "a string") -> str:
        n = self.count(f"the length of {field}", 1)
        text = bytes(self.mem[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value_type(self, field: str) -> int:
        vtype = self.scalar(4, f"the type of {field}")
        if vtype not in _SCALARS and vtype not in (8, 9):
            raise GGUFHeaderError(f"GGUF header: {field} has an unknown value type")
        return vtype

    def value(self, vtype: int, field: str, depth: int = 0) -> Any:
        if vtype == 8:
            return self.string(field)
        if vtype != 9:
            return self.scalar(vtype, field)
        if depth >= _MAX_NESTING:
            raise GGUFHeaderError(f"GGUF header: {field} nests arrays more than {_MAX_NESTING} deep")
        item = self.value_type(f"the items of {field}")
        if item in _SCALARS:
            dt = np.dtype(_SCALARS[item])
            count = self.count(f"the array {field}", dt.itemsize)
            values = np.frombuffer(self.mem, dt, count, self.pos)
            self.pos += dt.itemsize * count
            return [bool(v) for v in values] if item == _BOOL else values.tolist()
        if item == 8:
            count = self.count(f"the string array {field}", 8)  # each string has at least its u64 length
            mem, pos, size, out = self.mem, self.pos, self.size, [""] * count
            for i in range(count):
                if pos + 8 > size:
                    raise GGUFHeaderError(f"GGUF header: string {i} of {field} runs past the end of the file")
                n = int.from_bytes(mem[pos:pos + 8], "little")
                if n > size - pos - 8:
                    raise GGUFHeaderError(f"GGUF header: string {i} of {field} runs past the end of the file")
                out[i] = str(mem[pos + 8:pos + 8 + n], "utf-8", "replace")
                pos += 8 + n
            self.pos = pos
            return out
        count = self.count(f"the array {field}", 12)  # an array item has at least its type and count
        return [self.value(item, field, depth + 1) for _ in range(count)]


def _parse(buf: np.ndarray, spans: dict[str, tuple[int, int]] | None = None
           ) -> tuple[dict[str, object], list[tuple[str, tuple[int, ...], int, int]], int]:
    """(metadata, [(name, ggml dims, ggml type, offset in the data section)], start of the data section).
    ``spans``, where given, gets each metadata entry's bytes (start, end): a writer copies them as they are."""
    cur = _Cursor(buf)
    if bytes(cur.mem[:4]) != b"GGUF":
        raise GGUFHeaderError("no GGUF magic")
    cur.pos = 4
    version = cur.scalar(4, "the version")
    if version & 0xFFFF == 0 and version >> 16 in (2, 3):
        raise GGUFHeaderError("big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise GGUFHeaderError(f"GGUF version {version} (runlm reads 2 and 3)")
    n_tensors = cur.scalar(10, "the tensor count")
    n_kv = cur.count("the metadata count", _MIN_KV)
    if n_tensors * _MIN_TENSOR > cur.size - cur.pos:
        raise GGUFHeaderError("GGUF header: the tensor count declares more tensors than the file can hold")
    metadata: dict[str, object] = {}
    for i in range(n_kv):
        start = cur.pos
        key = cur.string(f"metadata key {i}")
        metadata[key] = cur.value(cur.value_type(repr(key)), repr(key))
        if spans is not None:
            spans[key] = (start, cur.pos)
    tensors = []
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}")
        n_dims = cur.scalar(4, f"the dimension count of tensor {name!r}")
        if n_dims > _MAX_DIMS:
            raise GGUFHeaderError(f"GGUF header: tensor {name!r} has more than {_MAX_DIMS} dimensions")
        dims = tuple(cur.scalar(10, f"the shape of tensor {name!r}") for _ in range(n_dims))
        tensors.append((name, dims, cur.scalar(4, f"the type of tensor {name!r}"),
                        cur.scalar(10, f"the offset of tensor {name!r}")))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or not 0 < align <= 1 << 20:
        raise GGUFHeaderError("GGUF header: general.alignment is not a positive integer of at most 1 MiB")
    return metadata, tensors, (cur.pos + align - 1) // align * align


def read_header(path: str | os.PathLike, spans: dict[str, tuple[int, int]] | None = None
                ) -> tuple[np.ndarray, dict[str, object], dict[str, TensorInfo]]:
    """(the file's bytes as a read-only mapping, metadata, tensors by name; in file order). Raises ValueError (or
    IndexError) on a truncated or corrupt file, OSError when it cannot be read. ``spans``: as _parse's."""
    try:
        data = np.memmap(Path(path), mode="r").view(np.ndarray)  # read-only, pages shared between processes
    except ValueError as e:  # numpy cannot map an empty file
        raise ValueError("the file is empty") from e
    metadata, entries, data_start = _parse(data, spans)
    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, offset in entries:
        qtype = BY_VALUE.get(type_id)
        if qtype is None:
            raise ValueError(f"tensor {name!r} has an unknown ggml type {type_id}")
        block, type_size = qtype.block, qtype.type_size
        n_values = math.prod(dims)  # python ints: a shape cannot overflow into a small size
        if n_values > data.nbytes * block or (dims and dims[0] % block):
            raise GGUFHeaderError(f"tensor {name!r} has a shape that does not fit its type or the file")
        info = TensorInfo(name, tuple(reversed(dims)), qtype.name, n_values // block * type_size, data_start + offset)
        if info.offset + info.n_bytes > data.nbytes:
            raise GGUFHeaderError(f"tensor {name!r} runs past the end of the file (needs bytes {info.offset}.."
                             f"{info.offset + info.n_bytes}, file has {data.nbytes}); truncated download?")
        tensors[name] = info
    return data, metadata, tensors


# llama.cpp's names for a model split in several files (gguf-split, convert_hf_to_gguf --split-max-*)
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAX_SHARDS = 1024


def shard_paths(path: Path, count: int) -> list[Path]:
    """The ``count`` files of a split model whose first is ``path`` (``<name>-00001-of-0000N.gguf``)."""
    m = SHARD_NAME.match(path.name)
    if m is None or int(m["count"]) != count:
        raise GGUFHeaderError(f"the model is split into {count} files, but this one is not named "
                              f"<name>-00001-of-{count:05d}.gguf")
    if int(m["no"]) != 1:
        raise GGUFHeaderError(f"this is file {int(m['no'])} of a split model: give the first, "
                              f"{m['stem']}-00001-of-{count:05d}.gguf")
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def read_model(path: str | os.PathLike) -> tuple[list[np.ndarray], dict[str, object], dict[str, TensorInfo]]:
    """``read_header`` over every file of a model: one file, or the shards of a split one (its first given; the
    others beside it, their tensors' ``part`` saying which file holds them). Metadata is the first file's."""
    data, metadata, tensors = read_header(path)
    count = metadata.get("split.count", 1)
    if count in (None, 0, 1):
        return [data], metadata, tensors
    if not isinstance(count, int) or isinstance(count, bool) or not 1 < count <= MAX_SHARDS:
        raise GGUFHeaderError(f"split.count is not a number of files from 2 to {MAX_SHARDS}")
    maps = [data]
    for i, shard in enumerate(shard_paths(Path(path), count)[1:], 1):
        if not shard.is_file():
            raise GGUFHeaderError(f"file {i + 1} of the split model, {shard.name}, is missing beside the first")
        shard_data, shard_meta, shard_tensors = read_header(shard)
        if shard_meta.get("split.no") != i:
            raise GGUFHeaderError(f"{shard.name} says it is not file {i + 1} of the split model")
        for name, info in shard_tensors.items():
            if name in tensors:
                raise GGUFHeaderError(f"tensor {name!r} is in two files of the split model")
            tensors[name] = dataclasses.replace(info, part=i)
        maps.append(shard_data)
    expected = metadata.get("split.tensors.count")
    if isinstance(expected, int) and expected != len(tensors):
        raise GGUFHeaderError(f"the split model's files hold {len(tensors)} tensors, its first says {expected}")
    return maps, metadata, tensors


def model_files(path: Path) -> list[Path]:
    """The files of the model whose (first) file is ``path``: itself, or a split model's every shard."""
    _, metadata, _ = read_header(path)
    count = metadata.get("split.count", 1)
    return shard_paths(path, count) if isinstance(count, int) and not isinstance(count, bool) and count > 1 else [path]
