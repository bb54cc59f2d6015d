"""The GPU runner (runlm.engine.runners.gpu) on the CPU (RUNLM_GPU_RUNNER=1: eager, the reference attention, the
device sampler on CPU tensors) gives the torch runner's tokens (exact numerics), through the engine's features:
batching, prefix caching, chunked prefill, preemption, n > 1, seeded sampling, logprobs, structured outputs; and
Gemma 2/3's KV groups, speculative decoding, mixtures of experts, LoRA, images, every decoder family (DeepSeek's
latent attention: tests/models/test_deepseek.py)."""
from __future__ import annotations

import json

import pytest

from runlm.engine.llm import LLM
from runlm.engine.runners.gpu import GPURunner
from runlm.engine.runners.torch_runner import ModelRunner
from runlm.engine.types.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.conftest import prompt_ids
from tests.fixtures.default_run import default_run

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
KW = dict(block_size=4, max_num_batched_tokens=64, kv_cache_memory="16MiB", exact_numerics=True, max_model_len=256)


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def _llm(path, gpu: bool, monkeypatch: pytest.MonkeyPatch, **kw) -> LLM:
    monkeypatch.setenv("RUNLM_NATIVE_RUNNER", "0")
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1" if gpu else "0")
    llm = LLM(str(path), **{**KW, **kw})
    assert isinstance(llm.engine.runner, GPURunner if gpu else ModelRunner)
    return llm


@pytest.fixture(scope="module")
def pair(tiny_model):
    """(torch runner, GPU runner) engines on the same tiny Qwen2."""
    mp = pytest.MonkeyPatch()
    try:
        yield _llm(tiny_model("qwen2"), False, mp), _llm(tiny_model("qwen2"), True, mp)
    finally:
        mp.undo()


def test_greedy_batch_equals_the_torch_runner(pair) -> None:
    torch_llm, gpu_llm = pair
    prompts = [{"prompt_token_ids": prompt_ids(3 + 9 * i, seed=i)} for i in range(6)]
    assert _tokens(gpu_llm.generate(prompts, GREEDY)) == _tokens(torch_llm.generate(prompts, GREEDY))


def test_seeded_n3_logprobs_equal_the_torch_runner(pair) -> None:
    torch_llm, gpu_llm = pair
    params = SamplingParams(n=3, temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=8, ignore_eos=True,
                            logprobs=2, prompt_logprobs=1)
    prompt = [{"prompt_token_ids": prompt_ids(9, seed=4)}]
    want, got = torch_llm.generate(prompt, params)[0], gpu_llm.generate(prompt, params)[0]
    assert _tokens([got]) == _tokens([want])
    for w, g in zip(want.outputs, got.outputs):
        assert w.logprobs is not None and g.logprobs is not None
        for wd, gd in zip(w.logprobs, g.logprobs):
            assert wd.keys() == gd.keys()
            assert all(abs(wd[t].logprob - gd[t].logprob) < 1e-4 for t in wd)
    assert want.prompt_logprobs is not None and got.prompt_logprobs is not None
    for wd, gd in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:]):
        assert wd is not None and gd is not None and wd.keys() == gd.keys()
        assert all(abs(wd[t].logprob - gd[t].logprob) < 1e-4 for t in wd)


def test_prefix_cache_hits_give_the_same_tokens(pair) -> None:
    torch_llm, gpu_llm = pair
    gpu_llm.reset_prefix_cache()
    prompt = [{"prompt_token_ids": prompt_ids(40, seed=5) + [11, 12]}]
    first = gpu_llm.generate(prompt, GREEDY)[0]
    second = gpu_llm.generate(prompt, GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 40
    assert _tokens([second]) == _tokens([first]) == _tokens(torch_llm.generate(prompt, GREEDY))


def test_structured_outputs_with_an_uploaded_grammar_mask(pair) -> None:
    torch_llm, gpu_llm = pair
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for params in (SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(
            json=schema)), SamplingParams(temperature=0.9, seed=5, max_tokens=24, logprobs=1,
                                          structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))):
        got = gpu_llm.generate(["JSON:", "Answer:"], params)
        want = torch_llm.generate(["JSON:", "Answer:"], params)
        assert _tokens(got) == _tokens(want)
        assert params.structured_outputs is not None
        first = got[0].outputs[0]
        if params.structured_outputs.json is not None and first.finish_reason == "stop":
            assert isinstance(json.loads(first.text)["a"], int)
        if params.structured_outputs.choice is not None:
            assert all(o.outputs[0].text in ("yes", "no", "maybe") for o in got)


def test_chunked_prefill_and_preemption(tiny_model, monkeypatch) -> None:
    path = tiny_model("qwen2")
    chunked = _llm(path, True, monkeypatch, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": prompt_ids(60, seed=1)}, {"prompt_token_ids": prompt_ids(6, seed=2)}]
    whole = _llm(path, False, monkeypatch, max_num_batched_tokens=256)
    assert _tokens(chunked.generate(prompts, GREEDY)) == _tokens(whole.generate(prompts, GREEDY))
    # 6 x (about 45 tokens) need about 70 blocks of 4; a cache of 30 preempts: the same tokens as a roomy cache.
    # A resumed sequence recomputes its K/V in a prefill of another shape, and a dense GEMM (cuBLAS; MKL on an
    # AMD CPU) is not batch-invariant in its last bits: over a full random vocabulary that flips a sampled token
    # now and then. Two candidates keep the draw about its random stream (reseeded or advanced by the recompute,
    # it would differ at about every other token), not about the GEMM's last bit.
    seeded = SamplingParams(temperature=0.8, top_k=2, seed=7, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt_ids(18 + i, seed=10 + i)} for i in range(6)]
    tight = _llm(path, True, monkeypatch, kv_cache_memory=30 * 4 * whole.engine.kv_bytes_per_token)
    assert _tokens(tight.generate(prompts, seeded)) == _tokens(chunked.generate(prompts, seeded))
    assert tight.engine.num_preemptions > 0
    assert _tokens(tight.generate(prompts, GREEDY)) == _tokens(whole.generate(prompts, GREEDY))


def test_a_gguf_model_gives_the_torch_runners_greedy_tokens(monkeypatch) -> None:
    """Q8_0 blocks dequantized on the device; the torch runner's exact mode dequantizes them on the host."""
    from tests.fixtures.gguf_convert import converted_gguf

    path = converted_gguf("llama", "q8_0")
    prompts = [{"prompt_token_ids": prompt_ids(7 + 5 * i, seed=20 + i)} for i in range(3)]
    gpu = _llm(path, True, monkeypatch)
    assert _tokens(gpu.generate(prompts, GREEDY)) == _tokens(_llm(path, False, monkeypatch).generate(
        prompts, GREEDY))


def test_gemma_reads_its_norms_as_one_plus_w(tiny_model, monkeypatch) -> None:
    """HF Gemma checkpoints store each norm's w of 1 + w: the device loader reads them through the family's own
    checkpoint_weights, as the host loader does (it once took w as stored, and every token differed)."""
    path = tiny_model("gemma")
    prompts = [{"prompt_token_ids": prompt_ids(10 + 7 * i, seed=i)} for i in range(2)]
    assert _tokens(_llm(path, True, monkeypatch).generate(prompts, GREEDY)) == \
        _tokens(_llm(path, False, monkeypatch).generate(prompts, GREEDY))


@pytest.mark.parametrize("recipe", ["gemma2", "gemma3", "olmo3"])
def test_sliding_window_layers_in_a_kv_group_of_their_own(tiny_model, monkeypatch, recipe: str) -> None:
    """Gemma 2/3: the window layers' cache is a KV group of its own (its blocks given back behind the window), the
    global layers' another; both groups' tables and slots go up with the step. Prompts longer than the window (16),
    prefilled in chunks, then decoded past it: the torch runner's tokens, with prefix-cache hits and a preemption."""
    from runlm.engine.core.kv_groups import HybridBlockManager

    path = tiny_model(recipe)
    prompts = [{"prompt_token_ids": prompt_ids(40 + 13 * i, seed=i)} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = _tokens(_llm(path, False, monkeypatch, max_num_batched_tokens=32).generate(prompts, params))
    gpu = _llm(path, True, monkeypatch, max_num_batched_tokens=32)
    assert isinstance(gpu.engine.blocks, HybridBlockManager)
    assert _tokens(gpu.generate(prompts, params)) == expected
    assert _tokens(gpu.generate(prompts[:1], params)) == expected[:1]  # its prompt's blocks from the prefix cache
    assert gpu.engine.stats().prefix_cache_hits > 0
    tight = _llm(path, True, monkeypatch, max_num_batched_tokens=32,
                 kv_cache_memory=40 * 4 * gpu.engine.kv_bytes_per_token)
    assert _tokens(tight.generate(prompts, params)) == expected
    assert tight.engine.num_preemptions > 0


# mixtures of experts (Mixtral's checkpoint names, Qwen2-MoE's gated shared expert, OLMoE's unnormalized top-k, dots1's
# and GLM-4.5's choice bias, GraniteMoE's stacked experts); hybrids with recurrent layers (a state slot per sequence:
# Mamba2 mixers, LFM2's short convolutions, Qwen3-Next's gated DeltaNet, MiniMax's lightning attention); RoPE on
# pairs (GLM-4, ERNIE, Cohere 2); LayerNorm families; multipliers (Granite, Falcon-H1); gpt-oss's attention sinks and
# Llama 4's chunked attention (chunks of 16: the prompts cross them); DeepSeek's latent attention; each from safetensors and from llama.cpp's GGUF (its stacked experts dequantized on the device, one weight each; Mamba2's A from the file's)
GPU_FAMILIES = ["mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "dots1", "glm4-moe", "granitemoe", "ernie4_5-moe",
                "granitemoehybrid", "bamba", "nemotron-h", "mamba2", "lfm2", "qwen3-next", "falcon-h1", "minimax",
                "glm4", "ernie4_5", "cohere2", "granite", "phi", "stablelm", "starcoder2", "apertus", "gpt-oss",
                "llama4-text", "deepseek-v2", "deepseek-v3"]
NO_GGUF = {"minimax", "dots1", "apertus"}  # (llama.cpp's converter writes no file, or runlm reads none, for these)


# the default run: one of each kind, from each format (DeepSeek's: tests/models/test_deepseek.py); `make test-slow`
# runs the whole matrix
@default_run("mixtral-q8_0", "qwen2-moe-safetensors", "granitemoehybrid-safetensors", "qwen3-next-q8_0", "glm4-q8_0",
             "cohere2-safetensors", "falcon-h1-safetensors", "gpt-oss-q8_0", "llama4-text-safetensors")
@pytest.mark.parametrize(("recipe", "fmt"), [
    *((r, "safetensors") for r in GPU_FAMILIES), *((r, "q8_0") for r in GPU_FAMILIES if r not in NO_GGUF)])
def test_families_give_the_torch_runners_tokens(tiny_model, monkeypatch, recipe: str, fmt: str) -> None:
    from tests.fixtures.gguf_convert import converted_gguf

    path = tiny_model(recipe) if fmt == "safetensors" else converted_gguf(recipe, fmt)
    prompts = [{"prompt_token_ids": prompt_ids(10 + 19 * i, seed=i)} for i in range(3)]
    kw = dict(max_num_batched_tokens=32)  # (prompts prefilled in chunks: a recurrent state carried across them)
    assert _tokens(_llm(path, True, monkeypatch, **kw).generate(prompts, GREEDY)) == \
        _tokens(_llm(path, False, monkeypatch, **kw).generate(prompts, GREEDY))


@pytest.mark.parametrize("checkpoint", ["gptq", "awq", "fp8-block", "fp8-channel"])
def test_prequantized_checkpoints_kept_as_stored_give_the_torch_runners_tokens(monkeypatch, checkpoint: str) -> None:
    """GPTQ (act-order), AWQ and FP8 (per-tile, per-row scales) checkpoints: every quantized matrix kept as stored on
    the device (runlm.models.gpu_prequantized; the Triton kernel is test_gpu_triton_quant_matmul.py's), the torch
    runner's greedy tokens in exact mode."""
    from runlm.models.gpu_prequantized import DeviceQuantized
    from runlm.models.linear import Linear
    from tests.fixtures.models import fp8_model, int4_model

    kind, _, variant = checkpoint.partition("-")
    path = int4_model(kind)[0] if kind != "fp8" else fp8_model(variant)[0]
    prompts = [{"prompt_token_ids": prompt_ids(7 + 9 * i, seed=i)} for i in range(3)]
    gpu = _llm(path, True, monkeypatch)
    kept = [m for m in gpu.engine.runner.loaded.model.modules() if isinstance(m, Linear) and m.device_blocks]
    assert len(kept) == 4 * gpu.engine.loaded.config.num_layers  # (each layer's qkv, o_proj, gate_up, down_proj)
    assert all(isinstance(s, DeviceQuantized) for m in kept for s in m.device_blocks)
    assert _tokens(gpu.generate(prompts, GREEDY)) == _tokens(_llm(path, False, monkeypatch).generate(prompts, GREEDY))


def test_a_prequantized_mixture_of_experts_routes_on_the_host(monkeypatch) -> None:
    """A Qwen2-MoE whose experts are FP8 (per-row scales): the fused MoE kernel stacks dense or GGUF experts only, so
    the layer keeps the host loop over its experts' kept matrices and says so; the torch runner's tokens."""
    from runlm.models.gpu_prequantized import DeviceQuantized
    from runlm.models.moe import SparseMoeBlock, host_routed_experts
    from tests.fixtures.models import fp8_model

    path = fp8_model("channel", "qwen2-moe")[0]
    prompts = [{"prompt_token_ids": prompt_ids(7 + 9 * i, seed=i)} for i in range(2)]
    gpu = _llm(path, True, monkeypatch)
    model = gpu.engine.runner.loaded.model
    assert host_routed_experts(model, "cuda") == "its experts are a pre-quantized checkpoint's (GPTQ/AWQ/FP8)"
    experts = next(m for m in model.modules() if isinstance(m, SparseMoeBlock)).experts
    assert all(isinstance(s, DeviceQuantized) for e in experts for s in e.down_proj.device_blocks)
    assert _tokens(gpu.generate(prompts, GREEDY)) == _tokens(_llm(path, False, monkeypatch).generate(prompts, GREEDY))


def test_speculative_decoding_keeps_the_greedy_tokens(tiny_model, smollm2_gguf, monkeypatch) -> None:
    """A draft model (a near copy: some drafts accepted, some not) and n-gram lookup on a real model asked to repeat
    a passage: each speculating sequence's 1 + k rows run in the step beside the others and are verified; the
    tokens are the torch runner's without speculation."""
    from tests.fixtures.near_copy import near_copy

    path = tiny_model("qwen2")
    prompts = [{"prompt_token_ids": prompt_ids(9 + 11 * i, seed=i)} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = _tokens(_llm(path, False, monkeypatch).generate(prompts, params))
    draft = {"model": str(near_copy("qwen2", 0.01)), "num_speculative_tokens": 3, "min_acceptance_rate": 0.0}
    gpu = _llm(path, True, monkeypatch, speculative_config=draft)
    assert _tokens(gpu.generate(prompts, params)) == expected
    stats = gpu.engine.spec_decode_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    passage = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
               "the ninety steps and wound the clockwork that turned the great lens.")
    kw = dict(block_size=16, max_num_batched_tokens=64, kv_cache_memory="64MiB")
    plain = _llm(smollm2_gguf, False, monkeypatch, **kw)
    prompt = {"prompt_token_ids": plain.encode_chat(
        [{"role": "user", "content": f"Quote the following passage word for word, then stop.\n\n{passage}"}])}
    want = _tokens(plain.generate([prompt], SamplingParams(temperature=0, max_tokens=16)))
    ngram = _llm(smollm2_gguf, True, monkeypatch, **kw,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert _tokens(ngram.generate([prompt], SamplingParams(temperature=0, max_tokens=16))) == want
    assert ngram.engine.spec_decode_stats().acceptance_rate > 0.6


def test_lora_adapters_mixed_in_a_batch(tiny_model, monkeypatch) -> None:
    """Two adapters and the base model in one batch, then an adapter removed while serving and its slot reused:
    the torch runner's tokens (the GPU runner holds the adapters in device slots, runlm.models.lora.DeviceLoRA,
    computed here by the slots' torch ops; the Triton kernels are test_gpu_triton_lora.py's)."""
    from runlm.engine.types.lora_request import LoRARequest
    from tests.fixtures.lora import peft_adapter

    path, lora = tiny_model("llama"), dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    adapters = [LoRARequest(f"a{i}", i + 1, str(peft_adapter("llama", 8, seed=i))) for i in range(2)]
    prompts = [{"prompt_token_ids": prompt_ids(9 + 5 * i, seed=i)} for i in range(3)]
    per_prompt = [adapters[0], None, adapters[1]]
    torch_runner, gpu = _llm(path, False, monkeypatch, **lora), _llm(path, True, monkeypatch, **lora)
    want = _tokens(torch_runner.generate(prompts, GREEDY, lora_request=per_prompt))
    assert _tokens(gpu.generate(prompts, GREEDY, lora_request=per_prompt)) == want
    assert want[0] != want[1]  # (the adapter changes the answer)
    assert gpu.engine.remove_lora(1)
    assert _tokens(gpu.generate(prompts[:2], GREEDY)) == _tokens(torch_runner.generate(prompts[:2], GREEDY))
    # the freed device slot taken by an adapter of q/v only: nothing of the removed one's other layers is left there
    narrow = LoRARequest("n", 3, str(peft_adapter("llama", 8, seed=5, targets=("q_proj", "v_proj"))))
    assert _tokens(gpu.generate(prompts, GREEDY, lora_request=narrow)) == \
        _tokens(torch_runner.generate(prompts, GREEDY, lora_request=narrow))
    # one adapter kept loaded: the second evicts the first while its request still runs (both held in slots)
    one = dict(enable_lora=True, max_loras=1, max_lora_rank=8)
    want = _tokens(_llm(path, False, monkeypatch, **one).generate(prompts[:2], GREEDY, lora_request=adapters))
    assert _tokens(_llm(path, True, monkeypatch, **one).generate(prompts[:2], GREEDY, lora_request=adapters)) == want


def _chat(text: str, *images) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                         {"type": "text", "text": text}]}]


@pytest.mark.parametrize("source", ["llava", "idefics3", "llava-gguf", "qwen2_5_vl"])
def test_images_give_the_torch_runners_tokens(monkeypatch, source: str) -> None:
    """The tower (a directory's, or llama.cpp's mmproj beside a GGUF) on the runner's device, each image's rows
    written over its placeholders in the step (Qwen2.5-VL: with its [3, T] M-RoPE positions); two images, prefilled
    in chunks; the encoder cache serves a second turn on the same image without the tower."""
    from tests.fixtures.vlm import test_image, vlm_dir
    from tests.fixtures.vlm.gguf import vlm_gguf

    path, kw = (vlm_dir(source), {}) if source != "llava-gguf" else (vlm_gguf("llava")[0],
                                                                      {"mmproj": str(vlm_gguf("llava")[1])})
    kw = {**kw, "max_model_len": 2048, "kv_cache_memory": "64MiB", "max_num_batched_tokens": 32}
    messages = _chat("Describe both.", test_image(96, 64, seed=3), test_image(64, 96, seed=4))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    gpu = _llm(path, True, monkeypatch, **kw)
    first = gpu.chat(messages, params)[0].outputs[0].token_ids
    assert first == _llm(path, False, monkeypatch, **kw).chat(messages, params)[0].outputs[0].token_ids
    assert gpu.chat(messages, params)[0].outputs[0].token_ids == first
    assert gpu.engine.encoder_cache.images_encoded == 2  # (the second turn's images came from the encoder cache)


def test_gemma3_images_attend_both_ways(monkeypatch) -> None:
    """Gemma 3's image tokens attend to each other both ways: those rows computed again with their spans' mask over
    the backend's cache; the prompt's logprobs are the torch runner's (without the second pass: 2.3 nats off)."""
    import numpy as np

    from tests.fixtures.vlm import test_image, vlm_dir

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    messages = _chat("Describe both.", test_image(96, 64, seed=3), test_image(64, 96, seed=4))
    kw = dict(max_model_len=2048, kv_cache_memory="64MiB", max_num_batched_tokens=32)
    got = [[lp.logprob for step in llm.chat(messages, params)[0].prompt_logprobs if step
            for _, lp in sorted(step.items())]
           for llm in (_llm(vlm_dir("gemma3"), gpu, monkeypatch, **kw) for gpu in (True, False))]
    assert len(got[0]) > 100 and np.abs(np.array(got[0]) - np.array(got[1])).max() < 1e-4


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_keep_the_tokens(tiny_model, monkeypatch, level: int) -> None:
    llm = _llm(tiny_model("qwen2"), True, monkeypatch)
    prompts = [{"prompt_token_ids": prompt_ids(12, seed=8)}]
    before = _tokens(llm.generate(prompts, GREEDY))
    llm.engine.sleep(level)
    assert llm.engine.runner.kv_caches == []
    llm.engine.wake_up()
    assert _tokens(llm.generate(prompts, GREEDY)) == before


def test_a_gguf_kept_dense_on_request_gives_the_same_tokens(monkeypatch) -> None:
    """RUNLM_GPU_GGUF_DENSE=1: the matrices dequantized at load instead of kept in their blocks; the same tokens."""
    from runlm.models.linear import Linear
    from tests.fixtures.gguf_convert import converted_gguf

    path = converted_gguf("llama", "q8_0")
    prompts = [{"prompt_token_ids": prompt_ids(9, seed=3)}]
    tokens = {}
    for dense in ("0", "1"):
        monkeypatch.setenv("RUNLM_GPU_GGUF_DENSE", dense)
        llm = _llm(path, True, monkeypatch)
        kept = [m for m in llm.engine.runner.loaded.model.modules() if isinstance(m, Linear) and m.device_blocks]
        assert bool(kept) == (dense == "0")
        tokens[dense] = _tokens(llm.generate(prompts, GREEDY))
    assert tokens["0"] == tokens["1"]
