"""Layer offload (--n-gpu-layers, runlm.models.offload): the GPU runner with its first layers on the CPU, on the
CPU (RUNLM_GPU_RUNNER=1: the "GPU" part is the GPU runner's own code on CPU tensors). The split model gives the
unsplit model's tokens: exactly where both parts compute alike (float32 weights), and the CPU layers keep a
GGUF's blocks as mapped for the CPU kernels (their 8-bit activations: log-probabilities within a bound)."""
from __future__ import annotations

import pytest
import torch

from runlm.engine.llm import LLM
from runlm.engine.runners.gpu import GPURunner
from runlm.engine.runners.gpu_offload import OffloadBackend
from runlm.engine.types.config import EngineConfig
from runlm.engine.types.sampling_params import SamplingParams
from runlm.models.linear import Linear
from runlm.models.offload import gpu_layers_that_fit, layer_of
from tests.engine.conftest import prompt_ids
from tests.fixtures.default_run import default_run

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
KW = dict(block_size=4, max_num_batched_tokens=64, kv_cache_memory="16MiB", max_model_len=256)


def _llm(path, monkeypatch: pytest.MonkeyPatch, **kw) -> LLM:
    monkeypatch.setenv("RUNLM_NATIVE_RUNNER", "0")
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1")
    llm = LLM(str(path), **{**KW, **kw})
    assert isinstance(llm.engine.runner, GPURunner)
    return llm


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def test_the_split_gives_the_whole_models_tokens(tiny_model, monkeypatch) -> None:
    """qwen2 (biases, GQA, tied embeddings) and SmolLM3 (4 layers, NoPE layers): every split of a float32 model gives the unsplit one's
    greedy and seeded tokens, with chunked prefill, prefix caching and preemption; the CPU layers' K/V are in
    the host's cache, the others' in the device's."""
    for recipe in ("qwen2", "smollm3"):
        path = tiny_model(recipe)
        whole = _llm(path, monkeypatch)
        layers = whole.engine.loaded.config.num_layers
        assert whole.engine.loaded.offload is None and not isinstance(whole.engine.runner.backend, OffloadBackend)
        prompts = [{"prompt_token_ids": prompt_ids(5 + 11 * i, seed=30 + i)} for i in range(4)]
        seeded = SamplingParams(temperature=0.8, top_k=2, seed=3, max_tokens=12, ignore_eos=True)
        want, want_seeded = _tokens(whole.generate(prompts, GREEDY)), _tokens(whole.generate(prompts, seeded))
        for k in sorted({1, layers - 1}):
            split = _llm(path, monkeypatch, n_gpu_layers=k, max_num_batched_tokens=16)
            loaded, backend = split.engine.loaded, split.engine.runner.backend
            assert loaded.offload is not None and loaded.offload.gpu_layers == k
            assert isinstance(backend, OffloadBackend) and backend.host_layers == layers - k
            assert [c[0].shape[0] > 0 for c in backend.host.caches] == [i < layers - k for i in range(layers)]
            assert [c[0].shape[0] > 0 for c in backend.device.caches] == [i >= layers - k for i in range(layers)]
            host_layer = loaded.model.model.layers[0]
            assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in host_layer.parameters())
            assert _tokens(split.generate(prompts, GREEDY)) == want, (recipe, k)
            assert _tokens(split.generate(prompts, seeded)) == want_seeded, (recipe, k)
        # the prefix cache serves both parts' K/V; a tight cache preempts and recomputes across the crossing
        split.reset_prefix_cache()
        first, second = (split.generate(prompts[3:], GREEDY)[0] for _ in range(2))
        assert second.num_cached_tokens > 0 and _tokens([first]) == _tokens([second]) == want[3:]
        tight = _llm(path, monkeypatch, n_gpu_layers=1, kv_cache_memory=12 * 4 * whole.engine.kv_bytes_per_token)
        assert _tokens(tight.generate(prompts, GREEDY)) == want
        assert tight.engine.num_preemptions > 0


def test_the_cpu_layers_keep_a_ggufs_blocks_for_the_cpu_kernels(monkeypatch) -> None:
    """On a Q8_0 file: the CPU layers' matrices are the file's blocks (Linear.ggml, the native kernels), the GPU
    layers' the device's (Linear.device_blocks); the 8-bit activations move the prompt's log-probabilities by
    little, and the greedy tokens of a batch are the batch's alone."""
    from tests.fixtures.gguf_convert import converted_gguf

    path = converted_gguf("llama", "q8_0")
    whole = _llm(path, monkeypatch)
    split = _llm(path, monkeypatch, n_gpu_layers=1)
    model = split.engine.loaded.model
    host = [m for i in range(split.engine.loaded.offload.host_layers) for m in model.model.layers[i].modules()
            if isinstance(m, Linear)]
    device = [m for m in model.model.layers[-1].modules() if isinstance(m, Linear)]
    assert host and all(m.ggml and not m.device_blocks for m in host)
    assert device and all(m.device_blocks and not m.ggml for m in device)
    monkeypatch.setenv("RUNLM_GPU_RUNNER", "0")
    fast = LLM(str(path), **KW)  # the torch runner's fast mode: every layer on the CPU kernels
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    prompt = [{"prompt_token_ids": prompt_ids(48, seed=8)}]
    ids = prompt[0]["prompt_token_ids"]
    want = whole.generate(prompt, params)[0].prompt_logprobs

    def furthest(llm: LLM) -> float:
        got = llm.generate(prompt, params)[0].prompt_logprobs
        assert want is not None and got is not None
        return max(abs(w[t].logprob - g[t].logprob) for w, g, t in zip(want[1:], got[1:], ids[1:]))

    # the CPU layers' 8-bit activations move the log-probabilities, by no more than fast mode's own
    assert 0 < furthest(split) <= furthest(fast), (furthest(split), furthest(fast))
    prompts = [{"prompt_token_ids": prompt_ids(6 + 7 * i, seed=50 + i)} for i in range(3)]
    together = _tokens(split.generate(prompts, GREEDY))
    assert together == [_tokens(split.generate([p], GREEDY))[0] for p in prompts]


def test_how_many_layers_fit() -> None:
    # the last layers first, each with its K/V; the embedding and head always on the device
    assert gpu_layers_that_fit([10, 10, 10, 10], fixed_bytes=20, kv_bytes_per_layer=5, room=65) == 3
    assert gpu_layers_that_fit([10, 10, 10, 50], fixed_bytes=20, kv_bytes_per_layer=5, room=65) == 0
    assert gpu_layers_that_fit([10, 10], fixed_bytes=0, kv_bytes_per_layer=0, room=100) == 2
    assert layer_of("model.layers.12.mlp.down_proj.weight") == 12 and layer_of("blk.3.attn_q.weight") == 3
    assert layer_of("model.embed_tokens.weight") is None and layer_of("output_norm.weight") is None


def test_what_a_split_refuses(tiny_model, monkeypatch) -> None:
    with pytest.raises(ValueError, match="n_gpu_layers must be"):
        EngineConfig(model="x", n_gpu_layers=0)
    with pytest.raises(ValueError, match="LoRA adapters live in GPU slots"):
        _llm(tiny_model("qwen2"), monkeypatch, n_gpu_layers=1, enable_lora=True)
    with pytest.raises(ValueError, match="does not split the mamba2 family's recurrent layers"):
        _llm(tiny_model("mamba2"), monkeypatch, n_gpu_layers=1)
    whole = _llm(tiny_model("qwen2"), monkeypatch, n_gpu_layers=99)  # more than it has: not split
    assert whole.engine.loaded.offload is None


FAMILIES = ["mixtral", "qwen3-moe", "gemma3", "gpt-oss", "llama4-text", "deepseek-v2", "glm4", "phi", "granite"]


@default_run("mixtral", "gemma3", "deepseek-v2")  # (`make test-slow`: all of them)
@pytest.mark.parametrize("recipe", FAMILIES)
def test_families_split_in_half_give_the_whole_models_tokens(tiny_model, monkeypatch, recipe: str) -> None:
    """Experts routed on the host beside experts stacked on the device, sliding-window KV groups (Gemma 3), sinks
    (gpt-oss), chunks (Llama 4), latents (DeepSeek), rotated pairs (GLM-4), LayerNorms (Phi), multipliers."""
    path = tiny_model(recipe)
    prompts = [{"prompt_token_ids": prompt_ids(10 + 19 * i, seed=i)} for i in range(3)]
    whole = _llm(path, monkeypatch, max_num_batched_tokens=32)
    half = max(1, whole.engine.loaded.config.num_layers // 2)
    split = _llm(path, monkeypatch, max_num_batched_tokens=32, n_gpu_layers=half)
    assert split.engine.loaded.offload is not None
    assert _tokens(split.generate(prompts, GREEDY)) == _tokens(whole.generate(prompts, GREEDY))


def test_the_memory_profile_skips_the_cpu_layers(tiny_model, monkeypatch) -> None:
    """The GPU's memory profile (one largest step) runs the GPU layers alone: the CPU layers pass their input on."""
    from runlm.models.attention import ForwardContext, forward_context
    from runlm.models.offload import host_layers_skipped

    split = _llm(tiny_model("smollm3"), monkeypatch, n_gpu_layers=2)
    model, host = split.engine.loaded.model, split.engine.loaded.offload.host_layers
    ids, positions = torch.tensor(prompt_ids(12, seed=2)), torch.arange(12)
    with torch.inference_mode(), forward_context(ForwardContext.no_cache([12])):
        whole = model(ids, positions)
        with host_layers_skipped(model):
            skipped = model(ids, positions)
        x = model.model.embed(ids)
        for layer in list(model.model.layers)[host:]:
            x = layer(positions, x)
        assert torch.equal(skipped, model.model.norm(x)) and not torch.equal(skipped, whole)
        assert torch.equal(model(ids, positions), whole)  # (and back to the whole model after it)
