"""A model is read once (runlm.models.spec): one open of a GGUF file (its header parsed once, its mapping then the
weights' memory) and one read of a directory's config.json per engine load, whichever runner the choice lands on
(native, torch, the GPU runner on a CPU), from the path given to the engine factory to a ready engine."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from runlm.engine.llm import LLM
from runlm.engine.runners.select import select_runner
from runlm.engine.types.config import EngineConfig
from runlm.formats import ModelFormatError
from runlm.models.spec import NotAGeneratorError, read_spec
from runlm.native import kernels
from tests.fixtures.gguf_convert import converted_gguf
from tests.fixtures.half_models import half_model

KW = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory="16MiB", max_model_len=128)

_opens: Counter[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _opens is not None and event == "open" and isinstance(args[0], str | Path):
        _opens[str(Path(args[0]).resolve())] += 1


sys.addaudithook(_audit)


def _load_counting(path: Path, monkeypatch: pytest.MonkeyPatch, gpu: bool, **kw) -> tuple[LLM, Counter[str]]:
    global _opens
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1" if gpu else "0")
    _opens = Counter()
    try:
        llm = LLM(str(path), **{**KW, **kw})
    finally:
        opens, _opens = _opens, None
    return llm, opens


@pytest.mark.parametrize(("gpu", "kw", "runner"), [(False, {}, "native"),
                                                    (False, dict(exact_numerics=True), "torch"),
                                                    (True, dict(exact_numerics=True), "gpu")],
                         ids=["native", "torch", "gpu-runner"])
def test_a_gguf_file_is_opened_once(gpu: bool, kw: dict, runner: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if runner == "native" and not kernels.available():
        pytest.skip("the native kernels are unavailable here")
    path = converted_gguf("llama", "q8_0")
    llm, opens = _load_counting(path, monkeypatch, gpu, **kw)
    assert llm.engine.choice.kind.name == runner
    assert opens[str(path.resolve())] == 1, opens


@pytest.mark.parametrize(("recipe", "gpu", "runner"), [("native-bf16", False, "native"), ("llama", False, "torch"),
                                                       ("llama", True, "gpu")])
def test_a_directorys_config_is_read_once(recipe: str, gpu: bool, runner: str, tiny_model,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if runner == "native" and not kernels.available():
        pytest.skip("the native kernels are unavailable here")
    path = half_model("llama", "bfloat16") if recipe == "native-bf16" else tiny_model(recipe)
    llm, opens = _load_counting(path, monkeypatch, gpu)
    assert llm.engine.choice.kind.name == runner
    assert opens[str((path / "config.json").resolve())] == 1, opens
    weights = [f for f in opens if f.endswith(".safetensors")]
    assert all(opens[f] <= 1 for f in weights), opens


def test_an_mmproj_beside_a_gguf_is_opened_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fixtures.vlm.gguf import vlm_gguf

    text, mmproj = vlm_gguf("gemma3", "q8_0")  # side by side: found, not named
    llm, opens = _load_counting(text, monkeypatch, False, max_model_len=512, kv_cache_memory="64MiB")
    assert llm.engine.modalities == ("text", "image")
    assert opens[str(text.resolve())] == 1 and opens[str(mmproj.resolve())] == 1, opens


def test_the_spec_says_what_the_model_is(smollm2_gguf: Path, tiny_model) -> None:
    spec = read_spec(smollm2_gguf)
    assert (spec.format, spec.task, spec.family) == ("gguf", "generate", "llama")
    by_type = spec.bytes_by_type()
    assert set(by_type) >= {"Q4_1"} and spec.weight_bytes == sum(by_type.values())
    assert spec.weight_bytes < smollm2_gguf.stat().st_size
    assert spec.tokenizer() is spec.tokenizer() and spec.config is not None and spec.config.eos_token_ids
    embed = read_spec(tiny_model("qwen3-embedding"))
    assert embed.task == "embed" and embed.format == "safetensors"
    with pytest.raises(NotAGeneratorError):
        embed.decoder_config()
    with pytest.raises(ModelFormatError, match="no such model"):
        read_spec(smollm2_gguf.parent / "missing.gguf")


def test_the_runner_choice_names_every_reason(smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = read_spec(smollm2_gguf)
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "0")
    exact = select_runner(spec, EngineConfig(model=str(smollm2_gguf), exact_numerics=True))
    assert exact.kind.name == "torch" and exact.reasons == ("exact numerics",)
    assert exact.describe() == "torch (exact numerics)"
    with pytest.raises(ValueError, match="kv_cache_dtype 'q8_0' needs the native runner.*exact numerics"):
        select_runner(spec, EngineConfig(model=str(smollm2_gguf), exact_numerics=True, kv_cache_dtype="q8_0"))
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1")
    assert select_runner(spec, EngineConfig(model=str(smollm2_gguf), enable_lora=True)).kind.name == "gpu"
    assert select_runner(spec, EngineConfig(model=str(smollm2_gguf))).kind.name == "gpu"
    if kernels.available():
        monkeypatch.setenv("RUNLM_GPU_RUNNER", "0")
        assert select_runner(spec, EngineConfig(model=str(smollm2_gguf))).describe() == "native"


def test_the_gpu_runner_takes_the_one_family_the_native_runner_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek's latent attention: not the native runner's (torch, named), the GPU runner's (from the spec alone)."""
    path = converted_gguf("deepseek-v3", "q8_0")
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1")
    assert select_runner(read_spec(path), EngineConfig(model=str(path))).kind.name == "gpu"
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "0")
    assert select_runner(read_spec(path), EngineConfig(model=str(path))).kind.name == "torch"
