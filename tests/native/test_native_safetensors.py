"""Safetensors model directories on the native runner (issue 30): bf16/fp16 weights computed on as stored, the
same kernels in the same order as the torch runner's fast path on the same directory (which keeps bf16/fp16
matrices as ggml BF16/F16 views too), so greedy tokens and logprobs are the same bit for bit; no fp32 copy of a
matrix; what the native runner does not do (fp32 matrices, bf16 compute, other families) runs on torch."""
from __future__ import annotations

import json
import logging
import mmap
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from runlm.engine.llm import LLM
from runlm.engine.runners.native import why_not_native
from runlm.engine.types.config import EngineConfig
from runlm.engine.types.sampling_params import SamplingParams
from runlm.formats import ModelFormatError
from runlm.formats.safetensors import SafetensorsDir
from runlm.models.native_safetensors import load_native_safetensors
from runlm.native import kernels
from tests.fixtures.default_run import default_run
from tests.fixtures.half_models import half_model
from tests.native.engines import native_and_torch

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels are unavailable here")

KW = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory="32MiB", max_model_len=256)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def _engines(path: Path) -> tuple[LLM, LLM]:
    return native_and_torch(str(path), **KW)


# llama: untied head; llama-tied: the logits read the embedding's rows; qwen2: q/k/v biases, tied; qwen3: per-head
# q/k norms; mistral: its own config class (without a sliding window, as Mistral 7B v0.2 onwards); phi3: q/k/v and
# gate/up stored fused (without LongRoPE and partial rotary, as Phi-3-mini-4k); smollm3: a layer without RoPE
CASES = [("llama", "bfloat16", ()), ("qwen2", "float16", ()), ("qwen3", "bfloat16", ()),
         ("phi3", "float16", ("rope_parameters", "partial_rotary_factor")), ("smollm3", "bfloat16", ()),
         pytest.param("llama-tied", "float16", (), marks=pytest.mark.slow),
         pytest.param("qwen2", "bfloat16", (), marks=pytest.mark.slow),
         pytest.param("qwen3", "float16", (), marks=pytest.mark.slow),
         pytest.param("mistral", "bfloat16", ("sliding_window",), marks=pytest.mark.slow)]


@default_run("llama-bfloat16-without0", "qwen2-float16-without1", "phi3-float16-without3", "llama-tied-float16-without5")
@pytest.mark.parametrize(("recipe", "dtype", "without"), CASES)
def test_tokens_and_logprobs_equal_the_torch_fast_path(recipe: str, dtype: str, without: tuple[str, ...]) -> None:
    native, fused = _engines(half_model(recipe, dtype, without))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
    a, b = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in (native, fused))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.outputs[0].logprobs for o in a] == [o.outputs[0].logprobs for o in b]  # the same floats
    # a row computes the same alone as batched (and the batch above is not trivially one row)
    alone = native.generate(PROMPTS[1:2], params, use_tqdm=False)[0]
    assert alone.outputs[0].logprobs == a[1].outputs[0].logprobs


def _mapped(a: np.ndarray) -> bool:
    """Whether an array's memory is a file mapping's (not a copy)."""
    base: object = a
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, mmap.mmap)


def test_matrices_stay_views_of_the_mapped_file() -> None:
    path = half_model("qwen2", "bfloat16")
    loaded = load_native_safetensors(path)
    assert loaded is not None and loaded.config.tie_word_embeddings
    decoder, head = loaded.model.decoder, loaded.model.head
    assert decoder is not None and head is not None
    matrices = [s for layer in decoder.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
                for s in w._keep[0]] + list(head._keep[0])
    assert all(_mapped(m) and m.dtype == np.uint8 for m in matrices)
    # what the model owns beyond the file: norms, biases and RoPE tables, a few percent of the matrices' bytes
    size = (path / "model.safetensors").stat().st_size
    assert sum(m.nbytes for m in matrices) > 0.9 * size
    assert head._keep[1] is None and decoder.layers[0].qkv._keep[1] is not None  # Qwen2's q/k/v biases, fp32
    # the bias is the checkpoint's bf16 values, widened exactly
    bias = decoder.layers[0].qkv._keep[1]
    assert bias.dtype == np.float32 and np.array_equal(bias.view(np.uint32) & 0xFFFF, np.zeros_like(bias, np.uint32))


def test_generation_never_imports_torch() -> None:
    path = half_model("qwen3", "bfloat16")
    code = textwrap.dedent(f"""
        import json, sys
        from runlm.engine.llm import LLM
        from runlm.engine.types.sampling_params import SamplingParams
        llm = LLM({str(path)!r}, max_model_len=128, kv_cache_memory="16MiB")
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        print(json.dumps({{"native": llm.engine.native, "torch": "torch" in sys.modules,
                          "tokens": len(out[0].outputs[0].token_ids)}}))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"native": True, "torch": False, "tokens": 6}


def test_what_the_native_runner_does_not_do_is_named(tiny_model, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="runlm.native"):
        assert load_native_safetensors(tiny_model("llama")) is None  # fp32 matrices: no ggml F32 dot product
        assert load_native_safetensors(tiny_model("gemma2")) is None
        assert load_native_safetensors(tiny_model("qwen3-embedding")) is None  # a bare decoder body embeds
    said = caplog.text
    assert "lm_head.weight of type F32" in said and "the gemma2 family" in said and "Qwen3Model architecture" in said
    config = EngineConfig(model="m", dtype="bfloat16")
    assert "bfloat16 compute" in (why_not_native(config) or "")


def test_a_damaged_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    source = half_model("llama", "bfloat16")
    for file in source.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated: the last tensors lie past the end
    with pytest.raises(ModelFormatError, match="does not fit its bytes"):
        SafetensorsDir(tmp_path)
    weights.write_bytes(b"\xff" * 4)
    with pytest.raises(ModelFormatError, match="shorter than its header"):
        SafetensorsDir(tmp_path)
    assert load_native_safetensors(tmp_path) is None  # the torch loader reports it, as for any damaged directory


def test_sleep_and_wake_reload_the_directory() -> None:
    native = LLM(str(half_model("qwen3", "bfloat16")), **KW)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = native.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    native.engine.sleep(2)
    assert native.engine.loaded.model.decoder is None
    native.engine.wake_up()
    assert native.engine.native and native.engine.loaded.model.decoder is not None
    assert native.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids == before


def test_a_sharded_checkpoint_reads_as_one(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    source = half_model("qwen2", "bfloat16")
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / shard), metadata={"format": "pt"})
    st = SafetensorsDir(tmp_path)
    assert sorted(st.tensors) == names and len(st.files) == 2
    bias = "model.layers.0.self_attn.q_proj.bias"
    assert np.array_equal(st.load_array(bias), tensors[bias].float().numpy())  # bf16 widened exactly
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    whole, sharded = LLM(str(source), **KW), LLM(str(tmp_path), **KW)
    assert whole.engine.native and sharded.engine.native
    a, b = (llm.generate(PROMPTS[:1], params, use_tqdm=False)[0] for llm in (whole, sharded))
    assert a.outputs[0].logprobs == b.outputs[0].logprobs
