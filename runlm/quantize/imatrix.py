"""Importance matrices as llama.cpp's ``llama-imatrix`` writes them: its GGUF format (``NAME.in_sum2`` and
``NAME.counts`` tensors) or the legacy ``.dat`` one; each entry the per-column mean of squared activations that
ggml's quantizers weigh their rounding error by (llama-quantize's load_imatrix, value for value)."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

MAX_ENTRIES = 1 << 16
MAX_VALUES = 1 << 28


class ImatrixError(ValueError):
    """The file is not an importance matrix runlm can read; the message says why."""


def read_imatrix(path: Path) -> dict[str, np.ndarray]:
    """{weight name: float32 values (ne0 per expert)}."""
    with open(path, "rb") as f:
        magic = f.read(4)
    return _read_gguf(path) if magic == b"GGUF" else _read_legacy(path)


def _read_gguf(path: Path) -> dict[str, np.ndarray]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ImatrixError(f"{path}: not a readable GGUF imatrix ({exc})") from None
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ImatrixError(f"{path}: {t.name} is {t.tensor_type.name}, not F32")
        for suffix, into in ((".in_sum2", sums), (".counts", counts)):
            if t.name.endswith(suffix):
                into[t.name[:-len(suffix)]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if not sums or set(sums) != set(counts):
        raise ImatrixError(f"{path}: an imatrix needs NAME.in_sum2 and NAME.counts tensors for each weight")
    out = {}
    for name, s in sums.items():
        c = np.rint(counts[name]).astype(np.float32)
        per = s.reshape(c.size, -1)
        out[name] = np.where(c[:, None] > 0, per / np.maximum(c[:, None], 1), 1.0).astype(np.float32).reshape(-1)
    return out


def _read_legacy(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    pos = 0

    def take(fmt: str) -> tuple:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise ImatrixError(f"{path}: truncated legacy imatrix")
        out = struct.unpack_from(fmt, data, pos)
        pos += size
        return out

    (n,) = take("<i")
    if not 1 <= n <= MAX_ENTRIES:
        raise ImatrixError(f"{path}: not an imatrix ({n} entries)")
    out = {}
    for _ in range(n):
        (length,) = take("<i")
        if not 0 < length <= 1024:
            raise ImatrixError(f"{path}: a name of {length} bytes")
        name = data[pos:pos + length].decode("utf-8", "replace")
        pos += length
        ncall, nval = take("<ii")
        if not 0 < nval <= MAX_VALUES or pos + 4 * nval > len(data):
            raise ImatrixError(f"{path}: {name}: {nval} values")
        values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).astype(np.float32)
        pos += 4 * nval
        out[name] = values / ncall if ncall > 0 else values
    return out
