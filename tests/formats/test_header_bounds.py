"""Untrusted headers (issue 33): every count and length in a GGUF or safetensors header is checked against
the bytes that remain before anything is allocated, and a malformed file is refused at once, the field named.
The fuzz tests throw mutated headers at both readers: a clean ModelFormatError/ValueError, in bounded time
and memory, never another exception."""
from __future__ import annotations

import json
import struct
import tempfile
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runlm.formats import ModelFormatError
from runlm.formats.gguf import GGUFFile
from runlm.formats.gguf_header import GGUFHeaderError, read_header
from runlm.store.metadata import _safetensors_header, count_parameters


def _kv_string_array(key: bytes, count: int) -> bytes:
    """A GGUF v3 file with no tensors and one key: an array of ``count`` strings, none of them present."""
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<IIQ", 9, 8, count))


def _write(tmp: Path, data: bytes, name: str = "m.gguf") -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("count", [1 << 24, 1 << 26, 1 << 63])
def test_a_string_array_bomb_is_refused_at_once(tmp_path: Path, count: int) -> None:
    # the 49-byte file: before, 2^24 strings cost 14 s and 177 MiB and then "succeeded"
    path = _write(tmp_path, _kv_string_array(b"t", count))
    assert path.stat().st_size == 49
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(GGUFHeaderError, match="string array 't'"):
        read_header(path)
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 0.5 and peak < 1 << 20


def _valid_gguf(tmp: Path) -> bytes:
    writer = gguf.GGUFWriter(str(tmp / "valid.gguf"), "llama")
    writer.add_context_length(128)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_scores([0.0, -1.0, -2.0])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return (tmp / "valid.gguf").read_bytes()


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return _valid_gguf(tmp_path_factory.mktemp("gguf"))


def test_the_valid_file_reads(tmp_path: Path, valid_gguf: bytes) -> None:
    _, md, tensors = read_header(_write(tmp_path, valid_gguf))
    assert md["tokenizer.ggml.tokens"] == ["a", "b", "ab"] and md["test.nested"] == [[1, 2], [3]]
    assert tensors["w"].shape == (2, 32)


def _header(n_tensors: int, kvs: bytes, n_kv: int, tensors: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tensors


def _key(name: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name


@pytest.mark.parametrize("data, field", [
    (_header(0, _key(b"k") + struct.pack("<IQ", 8, 1 << 40) + b"abc", 1), "'k'"),              # string length
    (_header(0, b"", 1 << 50), "metadata count"),                                             # kv count
    (_header(1 << 50, b"", 0), "tensor count"),                                               # tensor count
    (_header(0, _key(b"k") + struct.pack("<IIQ", 9, 4, 1 << 40), 1), "array 'k'"),            # numeric array
    (_header(0, _key(b"k") + struct.pack("<II", 9, 99) + bytes(8), 1), "items of 'k'"),        # unknown item type
    (_header(0, _key(b"k") + struct.pack("<I", 77), 1), "'k' has an unknown value type"),
    (_header(0, _key(b"k") + struct.pack("<II", 9, 9) + struct.pack("<QI", 1, 9) * 6 + bytes(16), 1), "nests"),
    (_header(0, _key(b"general.alignment") + struct.pack("<II", 4, 0), 1), "general.alignment"),
    (_header(1, b"", 0, _key(b"w") + struct.pack("<I", 9) + bytes(80)), "more than 4 dimensions"),
    (_header(1, b"", 0, _key(b"w") + struct.pack("<IQQIQ", 2, 1 << 40, 1 << 40, 0, 0)), "does not fit"),
    (_header(1, b"", 0, _key(b"w") + struct.pack("<IQI", 1, 32, 0) + bytes(3)), "offset of tensor 'w' runs past"),
])
def test_a_malformed_header_names_its_field(tmp_path: Path, data: bytes, field: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(GGUFHeaderError, match=field):
        read_header(path)
    with pytest.raises(ModelFormatError, match=field):  # what loading the model says
        GGUFFile(path)


def _bounded(call) -> None:  # type: ignore[no-untyped-def]
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        call()
    except (ValueError, ModelFormatError):  # GGUFHeaderError and ModelFormatError are ValueErrors
        pass
    finally:
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < 1.0, elapsed
    assert peak < 16 << 20, peak


_mutation = st.tuples(st.integers(0, 1 << 16), st.sampled_from(["byte", "u64", "u32", "cut"]),
                      st.integers(0, (1 << 64) - 1))


def _mutate(data: bytes, mutations: list[tuple[int, str, int]]) -> bytes:
    buf = bytearray(data)
    for pos, kind, value in mutations:
        if not buf:
            break
        pos %= len(buf)
        if kind == "byte":
            buf[pos] = value & 0xFF
        elif kind == "u64":
            buf[pos:pos + 8] = struct.pack("<Q", value)
        elif kind == "u32":
            buf[pos:pos + 4] = struct.pack("<I", value & 0xFFFFFFFF)
        else:
            del buf[pos:]
    return bytes(buf)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_fuzz_gguf_header(valid_gguf: bytes, mutations: list[tuple[int, str, int]]) -> None:
    # mutations land where counts live: the header's first few hundred bytes
    data = _mutate(valid_gguf, [(p % 400, k, v) for p, k, v in mutations])
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d), data)
        _bounded(lambda: read_header(path))
        _bounded(lambda: GGUFFile(path))


def _safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


VALID_ST = _safetensors({"__metadata__": {"format": "pt"},
                         "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                         "b": {"dtype": "F16", "shape": [4], "data_offsets": [16, 24]}}, bytes(24))


def test_safetensors_header_reads_and_counts(tmp_path: Path) -> None:
    path = _write(tmp_path, VALID_ST, "m.safetensors")
    assert count_parameters([path]) == (8, {"F32": 4, "F16": 4})


@pytest.mark.parametrize("data, field", [
    (struct.pack("<Q", 1 << 62) + b"{}", "header length runs past the end"),
    (b"\x01\x02", "too short"),
    (_safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 1 << 40]}}, bytes(8)), "data_offsets"),
    (_safetensors({"a": {"dtype": "F32", "shape": [1 << 30, 1 << 30], "data_offsets": [0, 8]}}, bytes(8)), "shape"),
    (_safetensors({"a": {"dtype": "F32", "shape": "x", "data_offsets": [0, 8]}}, bytes(8)), "shape"),
    (_safetensors({"a": 3}, b""), "dtype"),
    (struct.pack("<Q", 2) + b"\xff\xfe", "not UTF-8 JSON"),
    (_safetensors([1, 2], b""), "not a JSON object"),  # type: ignore[arg-type]
])
def test_a_malformed_safetensors_header_names_its_field(tmp_path: Path, data: bytes, field: str) -> None:
    with pytest.raises(ModelFormatError, match=field):
        _safetensors_header(_write(tmp_path, data, "m.safetensors"))


def test_a_safetensors_error_never_echoes_the_file(tmp_path: Path) -> None:
    # the leak: a secret's first 8 bytes came back as "safetensors header of 4995128901736877908 bytes"
    secret = b"TOPSECRETpassword"
    with pytest.raises(ModelFormatError) as info:
        _safetensors_header(_write(tmp_path, secret, "m.safetensors"))
    assert str(struct.unpack("<Q", secret[:8])[0]) not in str(info.value) and "SECRET" not in str(info.value)


@settings(max_examples=300, deadline=None)
@given(mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_fuzz_safetensors_header(mutations: list[tuple[int, str, int]]) -> None:
    data = _mutate(VALID_ST, mutations)
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d), data, "m.safetensors")
        _bounded(lambda: count_parameters([path]))
