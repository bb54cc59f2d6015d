"""Quantize a GGUF file (F32/F16/BF16 tensors) to Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K... as ``llama-quantize`` does:
its per-tensor type choices (plan.py), ggml's own quantizers (ggml_ops.py), its tensor order and metadata
(``general.file_type``, ``general.quantization_version``), an optional importance matrix (imatrix.py). The output
is a GGUF file llama.cpp and runlm both read; written beside the target and renamed into place when whole.
"""
from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

from runlm.formats.gguf_header import read_header
from runlm.quantize import ggml_ops
from runlm.quantize.imatrix import read_imatrix
from runlm.quantize.plan import FLOAT_TYPES, ModelFacts, file_type, llama_order, plan_types

QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION
SLAB_BYTES = 16 << 20  # float32 rows converted and quantized per task
_SKIPPED_KEYS = ("general.file_type", "general.quantization_version", "split.no", "split.count",
                 "split.tensors.count")
_U32, _STRING = 4, 8


class QuantizeError(ValueError):
    """A request runlm cannot quantize (the message says why and what would work)."""


@dataclass(slots=True)
class QuantizeReport:
    type_name: str
    size_in: int
    size_out: int
    seconds: float


Progress = Callable[[int, int], None]  # (input bytes done, input bytes in all)


def _facts(metadata: dict[str, object]) -> ModelFacts:
    arch = str(metadata.get("general.architecture", ""))

    def number(key: str) -> int:
        value = metadata.get(f"{arch}.{key}")
        return int(value) if isinstance(value, (int, np.integer)) else 0

    n_layer = number("block_count")
    heads, kv_heads = metadata.get(f"{arch}.attention.head_count"), metadata.get(f"{arch}.attention.head_count_kv")
    is_70b = n_layer == 80 and (arch == "qwen2" or arch == "llama" and heads != kv_heads)
    return ModelFacts(arch, n_layer, number("expert_count"), is_70b)


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _u32_kv(key: str, value: int) -> bytes:
    return _string(key) + struct.pack("<II", _U32, value)


def _str_kv(key: str, value: str) -> bytes:
    return _string(key) + struct.pack("<I", _STRING) + _string(value)


def _floats(raw: np.ndarray, qtype: T) -> np.ndarray:
    """Raw tensor bytes (a slab of whole rows) as float32."""
    if qtype == T.F32:
        return raw.view("<f4")
    if qtype == T.F16:
        return raw.view("<f2").astype(np.float32)
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)


def quantize_file(source: Path, target: Path, type_name: str, imatrix: Path | None = None,
                  threads: int | None = None, progress: Progress | None = None) -> QuantizeReport:
    """Write ``source`` (a GGUF file of float tensors) to ``target`` as ``type_name``."""
    key, ftype, _ = file_type(type_name)
    t0 = time.monotonic()
    spans: dict[str, tuple[int, int]] = {}
    try:
        data, metadata, infos_in = read_header(source, spans)
    except (ValueError, IndexError, OSError) as exc:
        raise QuantizeError(f"{source}: not a readable GGUF file ({exc})") from None
    if metadata.get("split.count", 1) not in (None, 0, 1):
        raise QuantizeError(f"{source}: one file of a model split in several; quantizing split models is not "
                            f"supported (merge them first, e.g. llama.cpp's gguf-split --merge)")
    order = llama_order(list(infos_in))
    shapes = [(n, tuple(reversed(infos_in[n].shape)), T[infos_in[n].qtype]) for n in order]
    weights = read_imatrix(imatrix) if imatrix is not None else None
    types = plan_types(shapes, key, _facts(metadata), weights is not None)
    for name, _, current in shapes:
        if types[name] != current and current not in FLOAT_TYPES:
            raise QuantizeError(f"{source.name}: {name} is already {current.name}; quantize from the F16, BF16 or "
                                f"F32 file (re-quantizing loses quality)")
        if types[name] != current and ggml_ops.requires_imatrix(types[name]) and \
                (weights is None or name not in weights):
            raise QuantizeError(f"{types[name].name} needs an importance matrix (--imatrix) for {name}")
    align = int(metadata.get("general.alignment", 32))  # type: ignore[call-overload]
    kv = [data[a:b].tobytes() for k, (a, b) in spans.items() if k not in _SKIPPED_KEYS]
    kv += [_u32_kv("general.quantization_version", QUANTIZATION_VERSION), _u32_kv("general.file_type", ftype)]
    if weights is not None and imatrix is not None:
        kv += [_str_kv("quantize.imatrix.file", imatrix.name), _u32_kv("quantize.imatrix.entries_count", len(weights))]
    infos, sizes, offset = [], [], 0
    for name, shape, _ in shapes:
        size = ggml_ops.row_size(types[name], shape[0]) * _rows(shape)
        infos.append(_string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
                     + struct.pack("<IQ", types[name], offset))
        sizes.append(size)
        offset += -(-size // align) * align
    header = b"GGUF" + struct.pack("<IQQ", 3, len(shapes), len(kv)) + b"".join(kv) + b"".join(infos)
    total = sum(infos_in[n].n_bytes for n in order)
    done = 0
    part = target.with_name(f".{target.name}.{os.getpid()}.part")
    workers = threads or os.cpu_count() or 1
    try:
        with open(part, "wb") as out, ThreadPoolExecutor(workers) as pool:
            out.write(header)
            out.write(b"\0" * (-len(header) % align))
            for (name, shape, current), size in zip(shapes, sizes):
                t = infos_in[name]
                raw = data[t.offset:t.offset + t.n_bytes]
                new = types[name]
                if new == current:
                    out.write(raw.data)
                else:
                    matrix = weights.get(name) if weights is not None else None
                    out.write(_quantized(raw, shape, current, new, matrix, pool, workers).data)
                out.write(b"\0" * (-size % align))
                done += t.n_bytes
                if progress is not None:
                    progress(done, total)
        part.replace(target)
    finally:
        part.unlink(missing_ok=True)
    return QuantizeReport(key, source.stat().st_size, target.stat().st_size, time.monotonic() - t0)


def _rows(shape: tuple[int, ...]) -> int:
    """A tensor's rows (ggml's order: ne0 is a row's length)."""
    return int(np.prod(shape[1:], dtype=np.int64))


def _quantized(raw: np.ndarray, shape: tuple[int, ...], current: T, new: T, matrix: np.ndarray | None,
               pool: ThreadPoolExecutor, workers: int) -> np.ndarray:
    """One tensor's rows quantized in slabs, side by side (a slab never crosses an expert: each has its own
    importance values)."""
    k, nrows = shape[0], _rows(shape)
    per_expert = shape[1] if len(shape) > 1 else 1
    if matrix is not None and matrix.size != k * (nrows // per_expert):
        matrix = None  # (llama.cpp skips an entry whose size does not match the tensor's)
    in_row, out_row = raw.nbytes // nrows, ggml_ops.row_size(new, k)
    out = np.empty(out_row * nrows, dtype=np.uint8)
    step = max(1, min(SLAB_BYTES // (4 * k), -(-nrows // workers)))

    def run(first: int, count: int) -> None:
        rows = np.ascontiguousarray(_floats(raw[first * in_row:(first + count) * in_row], current).reshape(count, k))
        imat = None if matrix is None else matrix[(first // per_expert) * k:(first // per_expert + 1) * k]
        ggml_ops.quantize_rows(new, rows, out[first * out_row:(first + count) * out_row], imat)

    tasks = []
    for start in range(0, nrows, per_expert):
        end = start + per_expert
        tasks += [(r, min(step, end - r)) for r in range(start, end, step)]
    list(pool.map(lambda a: run(*a), tasks))
    return out
