"""The GPU runner on a CUDA device (skipped without one): CUDA graphs, weights on the device, the memory profile,
the device sampler on the GPU. Self-contained (a random-weight Qwen2 with a word-level tokenizer, built here), so
it runs on a GPU machine without the CPU suite's model fixtures."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB = 512


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    target = tmp_path_factory.mktemp("qwen2-cuda")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(target, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))
    return target


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, VOCAB, 5 + 3 * i).tolist()} for i in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def _llm(path: Path, monkeypatch, gpu: bool = True, **kw):
    from runlm.engine.llm import LLM

    monkeypatch.setenv("RUNLM_GPU_RUNNER", "1" if gpu else "0")
    monkeypatch.setenv("RUNLM_NATIVE_RUNNER", "0")
    base = dict(device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256,
                block_size=16, kv_cache_memory="64MiB")
    return LLM(str(path), **{**base, **kw})


def test_graphs_and_eager_give_the_cpu_exact_tokens(qwen, monkeypatch) -> None:
    from runlm.engine.types.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = _prompts(5)
    cpu = _tokens(_llm(qwen, monkeypatch, gpu=False, device="cpu", exact_numerics=True,
                       kv_cache_memory="16MiB").generate(prompts, params))
    graphs = _llm(qwen, monkeypatch)
    if graphs.engine.runner.graphs:
        assert sorted(graphs.engine.runner.graphs) == [1, 2, 4, 8]
    assert _tokens(graphs.generate(prompts, params)) == cpu
    assert _tokens(_llm(qwen, monkeypatch, enforce_eager=True).generate(prompts, params)) == cpu


def test_bf16_seeded_sampling_is_reproducible_and_batch_independent(qwen, monkeypatch) -> None:
    from runlm.engine.types.sampling_params import SamplingParams

    llm = _llm(qwen, monkeypatch, dtype="bfloat16")
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=3, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = _prompts(6, seed=1)
    together = _tokens(llm.generate(prompts, params))
    assert _tokens(llm.generate(prompts[2:3], params))[0] == together[2]


def test_weights_load_in_their_stored_dtype_on_the_device(qwen) -> None:
    from runlm.models.gpu_load import load_to_device

    loaded = load_to_device(qwen, dtype="bfloat16", device="cuda")
    on_cpu = load_to_device(qwen, dtype="bfloat16", device="cpu")
    want = dict(on_cpu.model.named_parameters())
    for name, p in loaded.model.named_parameters():
        assert p.device.type == "cuda" and p.dtype == torch.bfloat16, name
        assert torch.equal(p.cpu(), want[name]), name


def test_kv_cache_from_the_memory_profile_and_refusal_naming_sizes(qwen, monkeypatch, caplog) -> None:
    import gc

    gc.collect()  # the other tests' engines and their caches
    torch.cuda.empty_cache()
    with caplog.at_level("INFO", logger="runlm.gpu"):
        llm = _llm(qwen, monkeypatch, gpu_memory_utilization=0.5, kv_cache_memory=None)
    assert "KV cache" in caplog.text
    total = torch.cuda.get_device_properties(0).total_memory
    cache = len(llm.engine.blocks.blocks) * 16 * llm.engine.kv_bytes_per_token
    assert 0.2 * total < cache < 0.5 * total
    del llm
    with pytest.raises(ValueError, match=r"GiB.*GiB"):
        _llm(qwen, monkeypatch, gpu_memory_utilization=1e-6, kv_cache_memory=None)


def test_device_dequantizers_equal_the_cpus() -> None:
    from runlm.models.gpu_blocks import DEVICE_QUANTS, dequantize_on_device

    rng = np.random.default_rng(0)
    for qtype, (per_block, nbytes, _) in DEVICE_QUANTS.items():
        raw = rng.integers(0, 256, (8, nbytes), dtype=np.uint8)
        d = rng.uniform(-0.05, 0.05, 8).astype(np.float16).view(np.uint8).reshape(8, 2)
        if qtype == "Q6_K":
            raw[:, 208:210] = d
        else:
            raw[:, 0:2] = d
            if qtype in ("Q4_K", "Q5_K"):
                raw[:, 2:4] = d
        t = torch.from_numpy(raw.reshape(-1).copy())
        assert torch.equal(dequantize_on_device(t.cuda(), qtype, (8, per_block)).cpu(),
                           dequantize_on_device(t, qtype, (8, per_block))), qtype


def test_device_sampler_on_the_gpu_equals_numpy() -> None:
    from runlm.engine.core.sequence import Sequence
    from runlm.engine.runners.gpu_sampler import sample_on_device
    from runlm.engine.sample import sampler as np_sampler
    from runlm.engine.sample.sampler import make_generator
    from runlm.engine.types.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=2, repetition_penalty=1.2, logprobs=1)]

    def seqs() -> list[Sequence]:
        return [Sequence("r", i, list(range(10 + i)), 8, p, generator=make_generator(p.seed))
                for i, p in enumerate(params)]

    raw = (np.random.default_rng(4).standard_normal((3, 1000)) * 3).astype(np.float32)
    want = np_sampler.sample_batch(raw, seqs(), None)
    got = sample_on_device(torch.from_numpy(raw).cuda(), seqs(), None)
    assert [g.token for g in got] == [w.token for w in want]
    for w, g in zip(want, got):
        if w.logprobs is not None:
            assert g.logprobs is not None and list(g.logprobs) == list(w.logprobs)
            assert all(abs(g.logprobs[t].logprob - w.logprobs[t].logprob) < 1e-5 for t in w.logprobs)


def test_a_gpu_run_builds_no_cpu_kernel(qwen) -> None:
    """Load, profile, capture and generate on CUDA in a fresh process: no CPU kernel is built or loaded (their build
    was 32 s of a 38 s cold load)."""
    import subprocess
    import sys

    code = ("import sys\nfrom runlm.engine.llm import LLM\nfrom runlm.engine.types.sampling_params import "
            "SamplingParams\nfrom runlm.kernels import build\n"
            f"llm = LLM({str(qwen)!r}, device='cuda', dtype='bfloat16', max_model_len=256)\n"
            "llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4))\n"
            "print(sorted(build._loaded))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout
