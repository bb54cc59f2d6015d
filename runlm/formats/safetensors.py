"""A safetensors model directory's tensors as numpy views of its memory-mapped files: no torch, no copy.

What the native runner needs to compute on a checkpoint's weights as stored (runlm.models.native_safetensors):
each tensor's dtype, shape and bytes, read from the files' own headers (the format: an 8-byte little-endian
header size, a JSON header of name -> dtype, shape, data_offsets, then the data). The interface is the one
runlm.formats.gguf.GGUFFile offers the native loader: ``tensors`` (name -> info with ``shape`` and ``qtype``,
ggml's name for the type), ``raw(name)`` and ``load_array(name)``.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from runlm.formats import ModelFormatError

# safetensors dtype -> (ggml's type name, bytes per value); the others keep their own name and cannot be computed on
_DTYPES = {"F32": ("F32", 4), "F16": ("F16", 2), "BF16": ("BF16", 2), "F64": ("F64", 8), "I8": ("I8", 1),
           "I16": ("I16", 2), "I32": ("I32", 4), "I64": ("I64", 8), "U8": ("U8", 1), "BOOL": ("BOOL", 1),
           "F8_E4M3": ("F8_E4M3", 1), "F8_E5M2": ("F8_E5M2", 1)}
_FLOATS = ("F32", "F16", "BF16")
_MAX_HEADER = 100 << 20


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{directory}: no config.json (a model directory needs config.json and "
                               f"*.safetensors)") from None
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{path}: not valid JSON ({exc})") from None


@dataclass(frozen=True, slots=True)
class TensorInfo:
    shape: tuple[int, ...]
    qtype: str  # ggml's type name (F32, F16, BF16) where ggml has the type; else safetensors' dtype name
    file: int  # index into SafetensorsDir.files
    begin: int  # byte offsets in that file
    end: int


class SafetensorsDir:
    """Every ``*.safetensors`` file of a model directory (a sharded checkpoint's too), each mapped read-only once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files = sorted(directory.glob("*.safetensors"))
        if not self.files:
            raise ModelFormatError(f"{directory}: no *.safetensors weights")
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: list[np.ndarray] = []
        for index, file in enumerate(self.files):
            data = np.memmap(file, mode="r").view(np.ndarray) if file.stat().st_size else np.empty(0, np.uint8)
            self._maps.append(data)
            for name, info in _header(file, data, index).items():
                if name in self.tensors:
                    raise ModelFormatError(f"{file}: tensor {name!r} is in another file too")
                self.tensors[name] = info

    def maps(self) -> list[np.ndarray]:
        """Each file's mapped bytes (uint8), in the order of ``files``."""
        return list(self._maps)

    def raw(self, name: str) -> np.ndarray:
        """uint8 [rows, row_bytes] view of a tensor's bytes (a vector as one row)."""
        info = self.tensors[name]
        data = self._maps[info.file][info.begin:info.end]
        return data.reshape(info.shape[0] if len(info.shape) == 2 else 1, -1)

    def load_array(self, name: str) -> np.ndarray:
        """A new float32 array of the tensor's shape (F32, F16 or BF16 as stored; exact conversions)."""
        info = self.tensors[name]
        if info.qtype not in _FLOATS:
            raise ModelFormatError(f"{self.directory}: tensor {name!r} is {info.qtype}, not a float type")
        data = self._maps[info.file][info.begin:info.end]
        if info.qtype == "BF16":  # bf16 is fp32's upper half
            values = (data.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            values = data.view("<f4" if info.qtype == "F32" else "<f2").astype(np.float32)
        return values.reshape(info.shape)


def _header(file: Path, data: np.ndarray, index: int) -> dict[str, TensorInfo]:
    def bad(why: str) -> ModelFormatError:
        return ModelFormatError(f"{file}: not a safetensors file ({why})")

    if data.nbytes < 8:
        raise bad("shorter than its header size")
    (n,) = struct.unpack("<Q", data[:8].tobytes())
    if n > _MAX_HEADER or 8 + n > data.nbytes:
        raise bad(f"a header of {n} bytes")
    try:
        header = json.loads(data[8:8 + n].tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"its header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(s) for s in entry["shape"])
            begin, end = (8 + n + int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has no dtype, shape and data_offsets") from None
        if dtype not in _DTYPES:
            raise bad(f"tensor {name!r} has an unknown dtype {dtype!r}")
        qtype, size = _DTYPES[dtype]
        if any(s < 0 for s in shape) or not 8 + n <= begin <= end <= data.nbytes or end - begin != prod(shape) * size:
            raise bad(f"tensor {name!r}'s {dtype} {list(shape)} does not fit its bytes [{begin}, {end})")
        out[name] = TensorInfo(shape, qtype, index, begin, end)
    return out
