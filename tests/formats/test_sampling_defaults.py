"""A model's recommended sampling settings, read from its files: generation_config.json (vLLM's
``--generation-config auto``) and GGUF ``general.sampling.*`` keys (llama.cpp's), with odd values dropped."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from runlm.catalog import BUILTIN_MODELS, recommended_sampling
from runlm.cli import build_parser
from runlm.cli.serve_engine import sampling_defaults
from runlm.formats.sampling_defaults import (
    checked,
    from_generation_config,
    ollama_parameters,
    read_sampling_defaults,
    to_ollama,
)
from runlm.store.inspect import inspect_model
from tests.fixtures.models import build_model, tinycoder_gguf

F32, U32 = gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.UINT32


def gguf_with_sampling(target: Path, keys: dict[str, MetadataDetails]) -> Path:
    """tinycoder's GGUF copied with extra metadata (gguf-py's own copier, as gguf_new_metadata.py runs it)."""
    reader = gguf.GGUFReader(tinycoder_gguf())
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, keys, [])
    return target


def test_gguf_general_sampling_keys_are_read(tmp_path: Path) -> None:
    path = gguf_with_sampling(tmp_path / "m.gguf", {
        gguf.Keys.General.SAMPLING_TEMP: MetadataDetails(F32, 0.6), gguf.Keys.General.SAMPLING_TOP_P: MetadataDetails(
            F32, 0.95), gguf.Keys.General.SAMPLING_TOP_K: MetadataDetails(gguf.GGUFValueType.INT32, 20),
        gguf.Keys.General.SAMPLING_MIN_P: MetadataDetails(F32, 0.05),
        gguf.Keys.General.SAMPLING_PENALTY_REPEAT: MetadataDetails(F32, 1.1),
        gguf.Keys.General.SAMPLING_MIROSTAT: MetadataDetails(U32, 2),
        gguf.Keys.General.SAMPLING_SEQUENCE: MetadataDetails(gguf.GGUFValueType.STRING, "kpt")})  # not a setting
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "mirostat": 2}
    assert read_sampling_defaults(path) == want
    assert inspect_model(path).sampling == want  # what the store keeps, and `runlm show` prints
    args = build_parser().parse_args(["serve-engine", str(path)])
    assert sampling_defaults(args, path) == want  # serve-engine's --generation-config auto
    args = build_parser().parse_args(["serve-engine", str(path), "--generation-config", "vllm",
                                      "--override-generation-config", '{"max_new_tokens": 64, "top_k": 5}'])
    assert sampling_defaults(args, path) == {"top_k": 5, "max_tokens": 64}


def test_a_gguf_without_the_keys_recommends_nothing() -> None:
    assert read_sampling_defaults(tinycoder_gguf()) == {}
    assert inspect_model(tinycoder_gguf()).sampling == {}


def test_generation_config_json(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(build_model("llama"), model)
    # a real transformers generation_config.json: ids and flags, no sampling settings
    assert from_generation_config(model) == {} == inspect_model(model).sampling
    config = json.loads((model / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.3, top_p=0.8, top_k=50, repetition_penalty=1.05, max_new_tokens=256,
                  min_p="high", max_length=20)  # a string and a field vLLM does not take are left out
    (model / "generation_config.json").write_text(json.dumps(config))
    want = {"temperature": 0.3, "top_p": 0.8, "top_k": 50, "repetition_penalty": 1.05, "max_tokens": 256}
    assert from_generation_config(model) == want == inspect_model(model).sampling == recommended_sampling(
        str(model), model)
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        from_generation_config(model)


def test_out_of_range_and_wrongly_typed_values_are_dropped() -> None:
    assert checked({"temperature": 7.0, "top_p": 0.0, "top_k": 2.5, "max_tokens": 0, "min_p": True,
                    "frequency_penalty": float("nan"), "presence_penalty": 0.5}) == {"presence_penalty": 0.5}


def test_the_builtin_catalogue_fills_in_what_smollm2s_file_lacks() -> None:
    path = BUILTIN_MODELS["smollm2"].path()
    assert path is not None
    assert read_sampling_defaults(path) == {}  # its GGUF has no general.sampling.* keys
    # SmolLM2-Instruct's model card: temperature 0.2, top_p 0.9; DRY over the generated tokens against loops
    assert recommended_sampling("smollm2", path) == recommended_sampling(str(path), path) == {
        "temperature": 0.0, "top_p": 0.9, "dry_multiplier": 0.8}
    assert ollama_parameters(to_ollama({"temperature": 0.2, "repetition_penalty": 1.1, "max_tokens": 9})).split() == [
        "temperature", "0.2", "repeat_penalty", "1.1", "num_predict", "9"]
    assert ollama_parameters({"stop": ["a b", "c"]}).splitlines() == ['stop                           "a b"',
                                                                     'stop                           "c"']


def test_serve_engine_flags(tmp_path: Path) -> None:
    path = BUILTIN_MODELS["smollm2"].path()
    assert path is not None

    def defaults(*flags: str) -> dict:
        return sampling_defaults(build_parser().parse_args(["serve-engine", "smollm2", *flags]), path)

    smollm2 = {"temperature": 0.0, "top_p": 0.9, "dry_multiplier": 0.8}
    assert defaults() == smollm2  # auto
    assert defaults("--generation-config", "vllm") == {}
    assert defaults("--override-generation-config", '{"temperature": 0.7}') == {**smollm2, "temperature": 0.7}
    (tmp_path / "generation_config.json").write_text('{"top_k": 3}')
    assert defaults("--generation-config", str(tmp_path)) == {"top_k": 3}
    for flags, message in ((["--generation-config", str(tmp_path / "none")], "no generation_config.json"),
                           (["--override-generation-config", "{"], "not JSON"),
                           (["--override-generation-config", "[1]"], "JSON object"),
                           (["--override-generation-config", '{"temprature": 1}'], "temprature"),
                           (["--override-generation-config", '{"temperature": 9}'], "temperature")):
        with pytest.raises(ValueError, match=message):
            defaults(*flags)

