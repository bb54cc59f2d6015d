"""Safetensors folders written as GGUF (runlm/quantize/convert.py) against llama.cpp's own convert_hf_to_gguf.py on
the same generated models: every tensor byte for byte, every metadata value but the pre-tokenizer's name (see the
module); bf16 weights kept as they are; then quantized from the folder as from upstream's file."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runlm.formats import ModelFormatError
from runlm.formats.gguf import GGUFFile
from runlm.formats.gguf_header import read_header
from runlm.formats.safetensors import SafetensorsDir
from runlm.quantize import quantize_file
from runlm.quantize.convert import convert_folder
from tests.fixtures.default_run import default_run
from tests.fixtures.gguf_convert import converted_gguf
from tests.fixtures.models import build_model

_OWN_KEYS = ("general.name", "general.type", "general.basename", "general.version", "general.size_label",
             "tokenizer.ggml.pre")


def _same(ours: Path, theirs: Path) -> None:
    _, m1, i1 = read_header(ours)
    _, m2, i2 = read_header(theirs)
    assert list(i1) and set(i1) == set(i2)
    a, b = GGUFFile(ours), GGUFFile(theirs)
    for name in i1:
        assert (i1[name].qtype, i1[name].shape) == (i2[name].qtype, i2[name].shape), name
        assert a.raw(name).tobytes() == b.raw(name).tobytes(), name
    keys = (set(m1) | set(m2)) - set(_OWN_KEYS)
    if "tokenizer.ggml.add_bos_token" not in m2:  # upstream writes it for some families; runlm always says
        keys.discard("tokenizer.ggml.add_bos_token")  # what the tokenizer does (its post-processor adds a BOS?)
    assert {k: m1.get(k) for k in keys} == {k: m2.get(k) for k in keys}


@default_run("llama-f32", "qwen3-f16")
@pytest.mark.parametrize("recipe,out_type", [("llama", "f32"), ("llama", "f16"), ("mistral", "f16"),
                                             ("qwen3", "f16")])
def test_the_gguf_equals_llama_cpps_converters(recipe: str, out_type: str, tmp_path: Path) -> None:
    ours = tmp_path / "ours.gguf"
    assert convert_folder(build_model(recipe), ours, out_type) == out_type.upper()
    _same(ours, converted_gguf(recipe, out_type))
    assert read_header(ours)[1]["tokenizer.ggml.pre"] == "gpt-2"  # smollm2's byte-level split, as HF splits it


def test_bf16_weights_stay_bf16_and_quantize_as_upstreams_file(tmp_path: Path) -> None:
    from tests.fixtures.half_models import half_model

    folder = half_model("qwen2", "bfloat16")
    assert convert_folder(folder, tmp_path / "bf16.gguf") == "BF16"  # auto: bf16 weights stay bf16
    gguf, source = GGUFFile(tmp_path / "bf16.gguf"), SafetensorsDir(folder)
    assert np.array_equal(gguf.load_array("token_embd.weight"), source.load_array("model.embed_tokens.weight"))
    # quantizing the folder (converted on the way) writes what quantizing upstream's F16 file writes
    from runlm.store.quantized import quantize_with_progress

    quantize_with_progress(build_model("llama"), tmp_path / "ours.q8.gguf", "Q8_0")
    quantize_file(converted_gguf("llama", "f16"), tmp_path / "theirs.q8.gguf", "Q8_0")
    _same(tmp_path / "ours.q8.gguf", tmp_path / "theirs.q8.gguf")


def test_what_it_cannot_convert_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="convert_hf_to_gguf"):
        convert_folder(build_model("gemma"), tmp_path / "x.gguf")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (the bench extra) absent")
def test_llama_cpp_reads_a_model_quantized_from_a_folder(tmp_path: Path) -> None:
    from runlm.store.quantized import quantize_with_progress

    out = tmp_path / "qwen2.q4_k_m.gguf"
    quantize_with_progress(build_model("qwen2"), out, "Q4_K_M")  # (upstream's converter cannot read this one)
    probe = ("import llama_cpp, sys; m = llama_cpp.Llama(sys.argv[1], verbose=False, n_ctx=64); "
             "print(len(m('hi', max_tokens=3, temperature=0)['choices'][0]['text']) > 0)")
    done = subprocess.run([sys.executable, "-c", probe, str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
