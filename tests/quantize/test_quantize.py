"""runlm quantize against llama.cpp's own quantizer (llama_model_quantize, where llama-cpp-python is installed):
the same file, byte for byte, for each type; llama.cpp's per-tensor choices; importance matrices in both of
llama-imatrix's formats; the CLI and the store."""
from __future__ import annotations

import importlib.util
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from runlm.formats.gguf import GGUFFile
from runlm.quantize import QuantizeError, quantize_file
from runlm.quantize.imatrix import read_imatrix
from runlm.quantize.plan import ModelFacts, plan_types
from tests.fixtures.models import tinycoder_gguf

LAYERS, EMBED, FFN, VOCAB = 16, 256, 512, 512
FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17,
          "Q6_K": 18, "F16": 1}


def _llama_gguf(path: Path, dtype: str = "f16") -> Path:
    """A 16-layer Llama-shaped GGUF (GQA: 4 heads, 2 KV heads), random weights, written as F16, BF16 or F32."""
    if path.exists():
        return path
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(EMBED)
    w.add_feed_forward_length(FFN)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)

    def add(name: str, *shape: int) -> None:
        x = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        if len(shape) == 1 or dtype == "f32":
            w.add_tensor(name, x)
        elif dtype == "f16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            raw = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(*shape[:-1], shape[-1] * 2)
            w.add_tensor(name, raw, raw_dtype=T.BF16)

    add("token_embd.weight", VOCAB, EMBED)
    add("output_norm.weight", EMBED)
    add("output.weight", VOCAB, EMBED)
    for i in range(LAYERS):
        for name, shape in (("attn_norm", (EMBED,)), ("attn_q", (EMBED, EMBED)), ("attn_k", (EMBED // 2, EMBED)),
                            ("attn_v", (EMBED // 2, EMBED)), ("attn_output", (EMBED, EMBED)), ("ffn_norm", (EMBED,)),
                            ("ffn_gate", (FFN, EMBED)), ("ffn_up", (FFN, EMBED)), ("ffn_down", (EMBED, FFN))):
            add(f"blk.{i}.{name}.weight", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _llama_gguf(tmp_path_factory.mktemp("quant") / "llama-f16.gguf")


def _llama_quantize(source: Path, target: Path, kind: str, imatrix: dict[str, np.ndarray] | None = None) -> None:
    """llama.cpp's own quantizer, in a child process (it prints to stdout; its libllama must not meet the
    libggml this process has loaded)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python (the bench extra) is not installed")
    code = ("import llama_cpp, sys, ctypes, json, numpy as np\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            f"p.ftype = {FTYPES[kind]}\np.nthread = 2\n"
            "Entry = llama_cpp.llama_model_imatrix_data\n"
            "if len(sys.argv) > 3:\n"
            "    data = np.load(sys.argv[3])\n"
            "    keep = [np.ascontiguousarray(data[k], dtype=np.float32) for k in data.files]\n"
            "    arr = (Entry * (len(keep) + 1))(*[Entry(k.encode(), v.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), "
            "v.size) for k, v in zip(data.files, keep)], Entry(None, None, 0))\n"
            "    p.imatrix = ctypes.cast(arr, ctypes.POINTER(Entry))\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n")
    args = [sys.executable, "-c", code, str(source), str(target)]
    if imatrix is not None:
        npz = target.with_suffix(".npz")
        np.savez(npz, **imatrix)
        args.append(str(npz))
    out = subprocess.run(args, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_K_M", "Q4_K_S", "Q6_K", "Q8_0", "Q4_0", "Q5_1"])
def test_the_same_file_as_llama_quantize(model: Path, tmp_path: Path, kind: str) -> None:
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    quantize_file(model, ours, kind, threads=2)
    _llama_quantize(model, theirs, kind)
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_bf16_and_f32_sources(tmp_path: Path, dtype: str) -> None:
    source = _llama_gguf(tmp_path / f"llama-{dtype}.gguf", dtype)
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    quantize_file(source, ours, "Q4_K_M", threads=2)
    _llama_quantize(source, theirs, "Q4_K_M")
    assert ours.read_bytes() == theirs.read_bytes()


def test_llama_cpps_mix_for_q4_k_m() -> None:
    """Q4_K_M: output Q6_K; attn_v and ffn_down Q6_K on llama.cpp's use_more_bits layers (the first and last
    eighth, every third between), Q4_K elsewhere; norms kept; a row 256 does not divide falls back to Q5_0."""
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    names += [f"blk.{i}.{n}.weight" for i in range(LAYERS) for n in ("attn_norm", "attn_v", "ffn_down")]
    shapes = [(n, (EMBED,) if n.endswith("norm.weight") else (EMBED, 64), T.F16) for n in names]
    shapes.append(("blk.0.attn_q.weight", (96, 64), T.F16))
    types = plan_types(shapes, "q4_k_m", ModelFacts("llama", LAYERS))
    more = [i for i in range(LAYERS) if types[f"blk.{i}.attn_v.weight"] == T.Q6_K]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15] == [i for i in range(LAYERS)
                                                     if types[f"blk.{i}.ffn_down.weight"] == T.Q6_K]
    assert types["output.weight"] == T.Q6_K and types["token_embd.weight"] == T.Q4_K
    assert types["output_norm.weight"] == T.F16 and types["blk.0.attn_q.weight"] == T.Q5_0  # 96 % 256, 96 % 32 == 0
    tied = plan_types([s for s in shapes if s[0] != "output.weight"], "Q4_K_M", ModelFacts("llama", LAYERS))
    assert tied["token_embd.weight"] == T.Q6_K  # tied embeddings get the output's type


def test_importance_matrix_in_both_formats_as_llama_quantize_uses_it(model: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    columns = {"ffn_down": FFN}
    entries = {f"blk.{i}.{n}.weight": rng.uniform(0.1, 4.0, columns.get(n, EMBED)).astype(np.float32)
               for i in range(LAYERS) for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                                "ffn_down")}
    legacy = tmp_path / "imatrix.dat"  # sums are value * ncall, as llama-imatrix writes them
    with open(legacy, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, v in entries.items():
            f.write(struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 10, v.size))
            f.write((v * 10).astype("<f4").tobytes())
        f.write(struct.pack("<i", 10) + struct.pack("<i", 4) + b"wiki")
    g = gguf.GGUFWriter(str(tmp_path / "imatrix.gguf"), "")
    g.add_type("imatrix")
    for name, v in entries.items():
        g.add_tensor(f"{name}.in_sum2", (v * 7).astype(np.float32))
        g.add_tensor(f"{name}.counts", np.array([7.0], dtype=np.float32))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    for path in (legacy, tmp_path / "imatrix.gguf"):
        got = read_imatrix(path)
        assert set(got) == set(entries) and all(np.allclose(got[k], entries[k], rtol=1e-6) for k in entries)
    plain, ours, theirs = tmp_path / "plain.gguf", tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    quantize_file(model, plain, "Q4_K_M")
    quantize_file(model, ours, "Q4_K_M", imatrix=legacy)
    f = GGUFFile(str(ours))
    assert f.metadata["quantize.imatrix.entries_count"] == len(entries)
    assert plain.read_bytes() != ours.read_bytes()  # the weights' rounding followed the matrix
    _llama_quantize(model, theirs, "Q4_K_M", read_imatrix(legacy))
    a, b = GGUFFile(str(ours)), GGUFFile(str(theirs))
    for name in entries:  # the same blocks (the files' metadata differ: llama-quantize records the imatrix itself)
        assert a.raw(name).tobytes() == b.raw(name).tobytes(), name


def test_refusals(model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown quantization type 'Q3_K_XL'"):
        quantize_file(model, tmp_path / "x.gguf", "Q3_K_XL")
    q = tmp_path / "q.gguf"
    quantize_file(model, q, "Q8_0")
    with pytest.raises(QuantizeError, match="already Q8_0"):
        quantize_file(q, tmp_path / "y.gguf", "Q4_K_M")
    (tmp_path / "junk.gguf").write_bytes(b"not a model")
    with pytest.raises(QuantizeError, match="not a readable GGUF"):
        quantize_file(tmp_path / "junk.gguf", tmp_path / "z.gguf", "Q8_0")
    assert not list(tmp_path.glob(".*.part"))


def test_quantized_tinycoder_is_read_by_runlm(tmp_path: Path) -> None:
    out = tmp_path / "tiny-q4_0.gguf"
    report = quantize_file(tinycoder_gguf(), out, "Q4_0")
    f = GGUFFile(str(out))
    assert f.metadata["general.file_type"] == 2 and report.size_out < report.size_in
    from runlm.engine.llm import LLM
    from runlm.engine.types.sampling_params import SamplingParams

    llm = LLM(str(out), kv_cache_memory=8 << 20)
    assert llm.generate(["def add(a, b):"], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids


def test_cli_quantizes_a_stored_model_into_the_store_or_a_file(tmp_path: Path) -> None:
    from runlm.store import ModelStore
    from tests.runner.daemon import runlm

    home = tmp_path / "home"
    ModelStore(home).pull("tinycoder")
    out = runlm(home, "quantize", "tinycoder", "tiny-q8", "q8_0", timeout=120)
    assert out.returncode == 0 and "Q8_0:" in out.stdout and "tiny-q8:latest" in out.stdout, out.stderr
    assert "tiny-q8:latest" in runlm(home, "ls").stdout
    shown = runlm(home, "show", "tiny-q8", "--json")
    assert '"Q8_0"' in shown.stdout, shown.stdout
    file = tmp_path / "t.gguf"
    assert runlm(home, "quantize", str(tinycoder_gguf()), str(file), "Q4_K_M", timeout=120).returncode == 0
    assert GGUFFile(str(file)).metadata["general.file_type"] == 15
    bad = runlm(home, "quantize", "tinycoder", "x.gguf", "q3_k_xl")
    assert bad.returncode == 1 and "unknown quantization type" in bad.stderr
