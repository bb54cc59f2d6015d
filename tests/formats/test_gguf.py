"""GGUF reading and dequantization, checked against gguf-py's reference implementation."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from runlm.formats import ModelFormatError
from runlm.formats.gguf import SUPPORTED_ARCHITECTURES, SUPPORTED_TYPES, GGUFFile, TensorInfo, dequantize
from tests.fixtures.models import smollm2_gguf, tinycoder_gguf

# gguf.quants.quantize implements these; the K quants it can only dequantize.
QUANTIZABLE = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# Byte offsets of the float16 scale fields inside one block of each block type.
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def reference(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """gguf-py's own dequantization of raw bytes (rows of bytes in, rows of floats out)."""
    rows = raw.reshape(int(np.prod(shape[:-1], dtype=np.int64)), -1)
    return gguf.quants.dequantize(rows, GGMLQuantizationType[qtype]).reshape(shape)


def random_blocks(rng: np.random.Generator, qtype: str, n_blocks: int) -> np.ndarray:
    """Random block bytes: every quant and packed-scale bit random, the f16 scales finite (some < 0)."""
    blocks = rng.integers(0, 256, (n_blocks, GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-4, 2, n_blocks)).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(-1)


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, str | None]]) -> Path:
    """A GGUF file made by gguf-py's writer; raw tensors are (uint8 bytes, qtype name)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=None if qtype is None else GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def smollm() -> GGUFFile:
    return GGUFFile(smollm2_gguf())


@pytest.fixture(scope="module")
def tiny() -> GGUFFile:
    return GGUFFile(tinycoder_gguf())


def test_supported_sets() -> None:
    assert SUPPORTED_TYPES == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
    assert SUPPORTED_ARCHITECTURES == {
        "llama", "mistral", "qwen2", "qwen3", "smollm", "gemma", "gemma2", "gemma3", "phi3", "olmo2", "exaone4",
        "hunyuan-dense", "arcee", "seed_oss", "qwen2moe", "qwen3moe", "olmoe", "smollm3", "granite", "ernie4_5",
        "stablelm", "phi2", "starcoder2", "cohere2", "glm4", "glm4moe", "dots1", "ernie4_5-moe", "granitemoe",
        "deepseek2", "apertus", "gpt-oss", "llama4", "granitehybrid", "nemotron_h", "nemotron_h_moe", "mamba2", "lfm2", "qwen3next", "falcon-h1", "bert"}


# --- dequantization against the reference ---------------------------------------------------

@pytest.mark.parametrize("which", ["smollm", "tiny"])
def test_real_tensors_match_reference(which: str, request: pytest.FixtureRequest) -> None:
    f: GGUFFile = request.getfixturevalue(which)
    checked: set[str] = set()
    for name, info in f.tensors.items():
        # one tensor of each type per file, plus the (largest, Q8_0) embedding of smollm2
        if info.qtype in checked and name != "token_embd.weight":
            continue
        checked.add(info.qtype)
        ours = dequantize(f.raw(name), info.qtype, info.shape)
        assert ours.dtype == np.float32 and ours.shape == info.shape
        np.testing.assert_array_equal(ours, reference(f.raw(name), info.qtype, info.shape), err_msg=name)
    assert checked == ({"Q4_1", "Q8_0", "F32"} if which == "smollm" else {"F16", "F32"})


@pytest.mark.parametrize("qtype", QUANTIZABLE)
def test_quantized_by_gguf_matches_reference(qtype: str) -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((24, 512)).astype(np.float32) * np.logspace(-3, 2, 24, dtype=np.float32)[:, None]
    values[3] = 0.0  # all-zero blocks: zero scales
    values[5, :64] = np.linspace(-1, 1, 64)
    raw = gguf.quants.quantize(values, GGMLQuantizationType[qtype])
    ours = dequantize(raw, qtype, values.shape)
    np.testing.assert_array_equal(ours, reference(raw.view(np.uint8), qtype, values.shape))
    step = {"F32": 0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 2e-2}.get(qtype, 0.25)  # sanity: close to the input
    assert np.all(np.abs(ours - values) <= step * np.abs(values).max(axis=1, keepdims=True) + 1e-30)


@pytest.mark.parametrize("qtype", sorted(F16_FIELDS))
def test_random_blocks_match_reference(qtype: str) -> None:
    """Every bit pattern of quants and packed scales; the only way to cover K quants gguf cannot make."""
    block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]
    raw = random_blocks(np.random.default_rng(1), qtype, 6 * 4096 // block)
    shape = (3, 2, 4096)
    np.testing.assert_array_equal(dequantize(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_random_half_floats_match_reference(qtype: str) -> None:
    raw = np.random.default_rng(2).integers(0, 256, 2 * 4096, dtype=np.uint8)  # includes inf and nan
    if qtype == "F16":
        ref = raw.view(np.float16).astype(np.float32)
    else:
        ref = reference(raw, qtype, (4096,))
    np.testing.assert_array_equal(dequantize(raw, qtype, (4096,)), ref)


def test_dequantize_never_returns_a_view_of_its_input(smollm: GGUFFile) -> None:
    raw = smollm.raw("blk.0.attn_norm.weight")  # F32: the one type that could be a plain view
    out = dequantize(raw, "F32", (576,))
    assert not np.shares_memory(out, raw) and out.flags.writeable


def test_dequantize_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="Q2_K"):
        dequantize(np.zeros(84, np.uint8), "Q2_K", (256,))
    with pytest.raises(ValueError, match="bytes"):
        dequantize(np.zeros(17, np.uint8), "Q4_0", (32,))
    with pytest.raises(ValueError, match="blocks"):
        dequantize(np.zeros(18, np.uint8), "Q4_0", (16,))


# --- metadata and tensor index --------------------------------------------------------------

def test_smollm2_metadata(smollm: GGUFFile) -> None:
    assert smollm.architecture == "llama"
    smollm.check_architecture()
    assert smollm.metadata["llama.context_length"] == 8192 == smollm.get(".context_length")
    assert smollm.get(".no_such_key", 7) == 7 and smollm.get("no.such.key") is None
    tokens = smollm.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == 49152 and all(type(t) is str for t in tokens)
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    token_type = smollm.metadata["tokenizer.ggml.token_type"]
    assert isinstance(token_type, list) and len(token_type) == 49152 and all(type(t) is int for t in token_type)
    merges = smollm.metadata["tokenizer.ggml.merges"]
    assert isinstance(merges, list) and merges[0] == "Ġ t" and all(type(m) is str for m in merges)
    assert isinstance(smollm.metadata["tokenizer.chat_template"], str)
    assert "im_start" in smollm.metadata["tokenizer.chat_template"]
    assert smollm.metadata["tokenizer.ggml.add_bos_token"] is False
    assert smollm.get(".rope.freq_base") == 100000.0 and type(smollm.get(".rope.freq_base")) is float
    assert not any(k.startswith("GGUF.") for k in smollm.metadata)  # reader bookkeeping, not file metadata
    assert len(smollm.tensors) == 272


def test_tinycoder_scores(tiny: GGUFFile) -> None:
    scores = tiny.metadata["tokenizer.ggml.scores"]
    assert isinstance(scores, list) and len(scores) == 32000 and all(type(s) is float for s in scores)
    assert tiny.get(".context_length") == 2048


def test_tensor_info_and_raw(smollm: GGUFFile) -> None:
    info = smollm.tensors["blk.0.attn_k.weight"]
    assert info == TensorInfo("blk.0.attn_k.weight", (192, 576), "Q4_1", 192 * 576 // 32 * 20, info.offset)
    assert smollm.tensors["token_embd.weight"].shape == (49152, 576)
    assert smollm.tensors["blk.0.attn_norm.weight"].shape == (576,)
    raw = smollm.raw(info.name)
    assert raw.dtype == np.uint8 and raw.nbytes == info.n_bytes
    assert not raw.flags.writeable and not raw.flags.owndata  # a read-only view of the mapping
    with open(smollm.path, "rb") as fh:
        fh.seek(info.offset)
        assert fh.read(info.n_bytes) == raw.tobytes()


def test_load(smollm: GGUFFile, tiny: GGUFFile) -> None:
    w = smollm.load("blk.0.attn_k.weight")
    assert w.dtype == torch.float32 and w.shape == (192, 576)
    np.testing.assert_array_equal(w.numpy(), reference(smollm.raw("blk.0.attn_k.weight"), "Q4_1", (192, 576)))
    half = tiny.load("blk.0.ffn_up.weight", torch.float16)
    assert half.dtype == torch.float16 and half.shape == (64, 16)
    np.testing.assert_array_equal(half.numpy(), tiny.raw("blk.0.ffn_up.weight").view(np.float16).reshape(64, 16))
    assert tiny.load("blk.0.attn_norm.weight", torch.bfloat16).dtype == torch.bfloat16


def test_written_file_roundtrip(tmp_path: Path) -> None:
    """Shapes of 1-3 dims and every supported type survive gguf-py's writer and our reader."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal((3, 5, 256)).astype(np.float32)
    tensors: dict[str, tuple[np.ndarray, str | None]] = {"vec": (values[0, 0], None), "plain": (values, None)}
    for qtype in QUANTIZABLE:
        tensors[f"q.{qtype}"] = (gguf.quants.quantize(values, GGMLQuantizationType[qtype]).view(np.uint8), qtype)
    for qtype in ("Q4_K", "Q5_K", "Q6_K"):
        tensors[f"q.{qtype}"] = (random_blocks(rng, qtype, 15).reshape(3, 5, -1), qtype)
    f = GGUFFile(write_gguf(tmp_path / "all.gguf", "qwen3", tensors))
    assert f.architecture == "qwen3" and f.get(".context_length") == 128
    assert f.tensors["vec"].shape == (256,)
    np.testing.assert_array_equal(f.load("plain").numpy(), values)
    for qtype in QUANTIZABLE + ["Q4_K", "Q5_K", "Q6_K"]:
        info = f.tensors[f"q.{qtype}"]
        assert info.qtype == qtype and info.shape == (3, 5, 256)
        np.testing.assert_array_equal(f.load(info.name).numpy(), reference(f.raw(info.name), qtype, info.shape))


# --- bad files ------------------------------------------------------------------------------

def _copy(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("keep", [0.5, -100, 10, 0])
def test_truncated_file(tmp_path: Path, keep: int | float) -> None:
    data = tinycoder_gguf().read_bytes()
    size = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    path = _copy(tmp_path, "cut-tiny.gguf", data[:size])
    with pytest.raises(ModelFormatError, match="cut-tiny.gguf") as e:
        GGUFFile(path)
    assert ("truncated" if size >= 4 else "empty") in str(e.value)


def test_bad_magic(tmp_path: Path) -> None:
    path = _copy(tmp_path, "magic.gguf", b"NOPE" + tinycoder_gguf().read_bytes()[4:])
    with pytest.raises(ModelFormatError, match="magic.gguf") as e:
        GGUFFile(path)
    assert "not a GGUF file" in str(e.value) and "NOPE" in str(e.value)


def test_missing_file_is_not_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        GGUFFile(tmp_path / "absent.gguf")


def test_unknown_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "snake.gguf", "mamba9000", {"w": (np.ones((2, 32), np.float32), None)})
    f = GGUFFile(path)  # readable: only building the model is impossible
    assert f.architecture == "mamba9000"
    assert f.load("w").shape == (2, 32)
    with pytest.raises(ModelFormatError, match="mamba9000") as e:
        f.check_architecture()
    assert "snake.gguf" in str(e.value)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"])
def test_rarer_types_dequantize_as_ggml_does(tmp_path: Path, qtype: str) -> None:
    """Exact mode reads these through gguf-py's dequantizer: the same floats as ggml's own."""
    from runlm.kernels import ggml

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    weight = np.random.default_rng(5).standard_normal((3, 2 * block)).astype(np.float32)
    if not ggml.available():
        pytest.skip("ggml's kernels are unavailable here")
    raw = ggml.quantize(torch.from_numpy(weight), GGMLQuantizationType[qtype]).numpy()
    path = write_gguf(tmp_path / "rare.gguf", "llama", {"w.weight": (raw, qtype)})
    f = GGUFFile(path)
    assert f.tensors["w.weight"].shape == (3, 2 * block)
    expected = ggml.dequantize(torch.from_numpy(raw), GGMLQuantizationType[qtype], 2 * block)
    assert torch.equal(f.load("w.weight"), expected)


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "TQ1_0"])
def test_unsupported_tensor_type(tmp_path: Path, qtype: str) -> None:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = np.random.default_rng(4).integers(0, 256, (2, size), dtype=np.uint8)
    tensors = {"ok": (np.ones(32, np.float32), None), "odd.weight": (raw, qtype)}
    path = write_gguf(tmp_path / "odd.gguf", "llama", tensors)
    f = GGUFFile(path)
    assert f.tensors["odd.weight"].qtype == qtype and f.tensors["odd.weight"].shape == (2, block)
    assert f.raw("odd.weight").nbytes == 2 * size
    with pytest.raises(ModelFormatError, match="odd.weight") as e:
        f.load("odd.weight")
    assert qtype in str(e.value) and "odd.gguf" in str(e.value)
    assert f.load("ok").sum().item() == 32.0


def test_unknown_tensor_name(tiny: GGUFFile) -> None:
    for call in (tiny.load, tiny.raw):
        with pytest.raises(ModelFormatError, match="no_such.weight") as e:
            call("no_such.weight")
        assert "tiny.gguf" in str(e.value)


def test_unknown_type_id(tmp_path: Path) -> None:
    """A type number ggml has never assigned is a corrupt file."""
    path = write_gguf(tmp_path / "typeid.gguf", "llama", {"w": (np.ones(32, np.float32), None)})
    field = gguf.GGUFReader(path).tensors[0].field
    offset = field.offset + 8 + len("w") + 4 + 8  # name length, name, n_dims, one dim -> the type id
    data = bytearray(path.read_bytes())
    assert int.from_bytes(data[offset:offset + 4], "little") == GGMLQuantizationType.F32
    data[offset:offset + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="typeid.gguf"):
        GGUFFile(path)
