"""What the GPU runner runs beyond a plain decoder (issue 41), each scenario in a child process of its own:

- lora: 64 streams of the 0.5B shape, the base model vs 8 adapters of rank 16 mixed across the requests (output
  tok/s, and their ratio: the target is >= 0.8x);
- spec: one stream, plain vs n-gram lookup (k=5) on a copy prompt (a passage the model is asked to repeat: the
  random model repeats the prompt's tail greedily often enough) and on ordinary (random) text;
- moe: a Qwen3-MoE-shaped random model (hidden 2048, 48 layers, 128 experts of 768, 8 a token), one stream's
  decode tok/s beside the bandwidth limit of its active parameters;
- gemma3: a Gemma 3-shaped model (sliding-window layers 5:1 beside global ones: two KV groups), 1 and 64 streams;
- mla: a DeepSeek-V2-Lite-shaped model (latent attention: a 576-value latent a token and layer in the cache; 64
  experts of 1408, 6 a token, 2 shared), 1 and 64 streams, and its cache's bytes per token;
- image: a vision-language model's TTFT for one image on the runner's device against the same on the CPU;
- offload (issue 42): a Qwen2.5-7B-shaped bf16 model, one stream's decode tok/s wholly on the GPU, with half its
  layers on the GPU (--n-gpu-layers, and the automatic split under a --gpu-memory-utilization that holds about
  half), and wholly on the CPU (the runner the CPU picks, its threads).

    python bench/gpu_reach_bench.py [--scenarios lora spec moe gemma3 mla image offload]   # needs CUDA
    python bench/gpu_reach_bench.py --smoke    # tiny shapes on the CPU (RUNLM_GPU_RUNNER=1): end to end, no figures

Writes bench/results/gpu_reach_bench.json and .md (``--smoke``: gpu_reach_bench_smoke.*).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_bench import BANDWIDTH, CACHE, RESULTS, SHAPES, _sync, _tokenizer, prompts  # noqa: E402

SCENARIOS = ("lora", "spec", "moe", "gemma3", "mla", "image", "offload")
# the scenarios' own model shapes (the dense one is gpu_bench's Qwen2.5 shape); smoke: tiny, on the CPU
MOE = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
           num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
           vocab_size=49152, max_position_embeddings=4096, norm_topk_prob=True)
GEMMA3 = dict(hidden_size=2560, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
              intermediate_size=10240, vocab_size=49152, sliding_window=1024, max_position_embeddings=8192,
              query_pre_attn_scalar=256)
DEEPSEEK_V2_LITE = dict(hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
                        first_k_dense_replace=1, intermediate_size=10944, vocab_size=49152,
                        max_position_embeddings=4096, topk_method="greedy")
QWEN25_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 intermediate_size=18944, vocab_size=152064, max_position_embeddings=4096, tie_word_embeddings=False)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, max_position_embeddings=512)


def build(kind: str, smoke: bool, device: str, dtype: str) -> Path:
    """A random-weight model of the scenario's shape, saved as safetensors on first use."""
    target = CACHE / f"gpu-reach-{kind}-{'smoke' if smoke else 'full'}-{dtype}"
    if (target / "config.json").exists():
        return target
    import torch
    import transformers

    if kind == "moe":
        config = transformers.Qwen3MoeConfig(**(dict(MOE, **TINY, num_experts=8, num_experts_per_tok=2,
                                                     moe_intermediate_size=32) if smoke else MOE))
    elif kind == "mla":
        config = transformers.DeepseekV2Config(**(dict(DEEPSEEK_V2_LITE, **TINY, kv_lora_rank=32, qk_nope_head_dim=16,
                                                       qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                                                       num_experts_per_tok=2, moe_intermediate_size=32)
                                                  if smoke else DEEPSEEK_V2_LITE))
    elif kind == "offload":
        shape = dict(QWEN25_7B, **dict(TINY, num_hidden_layers=4)) if smoke else QWEN25_7B
        config = transformers.Qwen2Config(**shape)
    else:
        config = transformers.Gemma3TextConfig(**(dict(GEMMA3, **TINY, sliding_window=16) if smoke else GEMMA3))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    tmp = target.with_name(target.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    _tokenizer(tmp, config.vocab_size)
    os.replace(tmp, target)
    return target


def _llm(path: str, cfg: dict, **kw):
    os.environ["RUNLM_GPU_RUNNER"] = "1"
    from runlm.engine.llm import LLM

    memory = {"kv_cache_memory": "64MiB"} if cfg["device"] == "cpu" else {}
    return LLM(path, device=cfg["device"], dtype=cfg["dtype"], max_model_len=cfg["max_len"], **memory, **kw)


def _tok_s(llm, batch: list[list[int]], output: int, lora: list | None = None) -> float:
    """Output tok/s of the batch (after a warm-up on its first two prompts); ``lora``: an adapter per prompt."""
    from runlm.engine.types.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in batch[:2]], params, use_tqdm=False,
                 lora_request=lora[:2] if lora else None)
    _sync(llm.engine.config.device)
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False, lora_request=lora)
    _sync(llm.engine.config.device)
    return sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t0)


def run_lora(cfg: dict) -> dict:
    from runlm.engine.types.lora_request import LoRARequest
    from tests.fixtures.lora import write_peft_adapter

    base = build_dense(cfg)
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_peft_adapter(
        base, CACHE / f"{base.name}-lora-{i}", rank=16, seed=i, scale=0.01))) for i in range(8)]
    streams = cfg["streams"]
    batch = prompts(streams, cfg["prompt"], cfg["vocab"], 1)
    plain = _tok_s(_llm(str(base), cfg, max_num_seqs=streams), batch, cfg["output"])
    llm = _llm(str(base), cfg, max_num_seqs=streams, enable_lora=True, max_loras=8, max_lora_rank=16)
    mixed = _tok_s(llm, batch, cfg["output"], lora=[adapters[i % 8] for i in range(streams)])
    return {"base_tok_s": plain, "lora_tok_s": mixed, "ratio": mixed / plain}


def run_spec(cfg: dict) -> dict:
    base = str(build_dense(cfg))
    vocab, n = cfg["vocab"], cfg["prompt"]
    passage = prompts(1, n // 4, vocab, 5)[0]
    copy = passage * 4  # a prompt that repeats itself: n-gram lookup finds its continuation in it
    text = prompts(1, n, vocab, 6)[0]
    ngram = {"method": "ngram", "num_speculative_tokens": 5}
    plain, spec = _llm(base, cfg), _llm(base, cfg, speculative_config=ngram)
    out = {}
    for name, prompt in (("copy", copy), ("text", text)):
        a, b = _tok_s(plain, [prompt], cfg["output"]), _tok_s(spec, [prompt], cfg["output"])
        out |= {f"{name}_plain_tok_s": a, f"{name}_ngram_tok_s": b, f"{name}_ratio": b / a}
    out["acceptance_rate"] = spec.engine.spec.stats.acceptance_rate if spec.engine.spec else None
    return out


def run_moe(cfg: dict) -> dict:
    path = build("moe", cfg["smoke"], cfg["device"], cfg["dtype"])
    llm = _llm(str(path), cfg)
    out = {"tok_s_1": _tok_s(llm, prompts(1, cfg["prompt"], cfg["vocab"]), cfg["output"])}
    active = llm.engine.loaded.config.num_active_params  # (the weights one token reads)
    if cfg["device"].startswith("cuda"):
        import torch

        bw = next((b for key, b in BANDWIDTH.items() if key in torch.cuda.get_device_name()), None)
        if bw:
            out["limit_tok_s"] = bw / (active * 2)
            out["share_of_limit"] = out["tok_s_1"] / out["limit_tok_s"]
    return out


def run_gemma3(cfg: dict) -> dict:
    path = build("gemma3", cfg["smoke"], cfg["device"], cfg["dtype"])
    llm = _llm(str(path), cfg, max_num_seqs=cfg["streams"])
    return {"tok_s_1": _tok_s(llm, prompts(1, cfg["prompt"], cfg["vocab"]), cfg["output"]),
            f"tok_s_{cfg['streams']}": _tok_s(llm, prompts(cfg["streams"], cfg["prompt"], cfg["vocab"], 2),
                                              cfg["output"])}


def run_mla(cfg: dict) -> dict:
    path = build("mla", cfg["smoke"], cfg["device"], cfg["dtype"])
    llm = _llm(str(path), cfg, max_num_seqs=cfg["streams"])
    mc, per_token = llm.engine.loaded.config, llm.engine.kv_bytes_per_token
    itemsize = per_token // (mc.num_layers * sum(mc.kv_cache_shape[1:]))
    per_head = mc.num_layers * mc.num_heads * (mc.head_dim + mc.v_head_dim) * itemsize  # (every head's K and V)
    return {"tok_s_1": _tok_s(llm, prompts(1, cfg["prompt"], cfg["vocab"]), cfg["output"]),
            f"tok_s_{cfg['streams']}": _tok_s(llm, prompts(cfg["streams"], cfg["prompt"], cfg["vocab"], 2),
                                              cfg["output"]),
            "kv_bytes_per_token": per_token, "per_head_kv_bytes_per_token": per_head}


def run_offload(cfg: dict) -> dict:
    import gc

    import torch

    from runlm.models.offload import weight_bytes_on_device
    from runlm.models.spec import as_spec

    path = str(build("offload", cfg["smoke"], "cpu", cfg["dtype"]))
    batch, output = prompts(1, cfg["prompt"], cfg["vocab"], 3), max(4, cfg["output"] // 4)
    layers = as_spec(path).decoder_config().num_layers
    out: dict = {"layers": layers, "weights_gib": sum(weight_bytes_on_device(as_spec(path), 2, ()).values()) / 2**30}

    def measure(name: str, **kw) -> None:
        llm = _llm(path, cfg, **kw)
        split = llm.engine.loaded.offload
        out[f"{name}_gpu_layers"] = layers if split is None else split.gpu_layers
        out[f"{name}_tok_s"] = _tok_s(llm, batch, output)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    measure("whole_gpu")
    measure("half", n_gpu_layers=layers // 2)
    if cfg["device"].startswith("cuda"):  # a share that holds about half the weights: the split picked for it
        total = torch.cuda.get_device_properties(0).total_memory
        measure("auto", gpu_memory_utilization=min(0.95, (out["weights_gib"] * 2**30 / 2 + 2 * 2**30) / total))
    os.environ["RUNLM_GPU_RUNNER"] = "0"
    from runlm.engine.llm import LLM

    cpu = LLM(path, device="cpu", max_model_len=cfg["max_len"], kv_cache_memory="256MiB")
    out["whole_cpu_tok_s"] = _tok_s(cpu, batch, output)
    out["half_vs_cpu"] = out["half_tok_s"] / out["whole_cpu_tok_s"]
    return out


def run_image(cfg: dict) -> dict:
    from runlm.engine.llm import LLM
    from runlm.engine.types.sampling_params import SamplingParams
    from tests.fixtures.vlm import test_image, vlm_dir

    path = str(vlm_dir("llava"))  # (the fixture's tiny LLaVA: the tower's share of TTFT, device against host)
    messages = [{"role": "user", "content": [{"type": "image", "image": test_image(336, 336, seed=1)},
                                             {"type": "text", "text": "Describe."}]}]
    params = SamplingParams(temperature=0, max_tokens=1)
    out = {}
    for where, kw in (("device", dict(device=cfg["device"], dtype=cfg["dtype"])), ("cpu", {})):
        os.environ["RUNLM_GPU_RUNNER"] = "1" if where == "device" else "0"
        llm = LLM(path, max_model_len=2048, kv_cache_memory="256MiB", **kw)
        llm.chat(messages, params)  # warm-up: the first image through the tower
        times = []
        for _ in range(3):
            llm.reset_mm_cache()
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            llm.chat(messages, params)
            times.append(time.perf_counter() - t0)
        out[f"ttft_ms_{where}"] = 1000 * sorted(times)[1]
    out["cpu_over_device"] = out["ttft_ms_cpu"] / out["ttft_ms_device"]
    return out


def build_dense(cfg: dict) -> Path:
    from bench.gpu_bench import build_model

    return build_model("smoke" if cfg["smoke"] else "0.5b", cfg["device"], cfg["dtype"])


RUNS = {"lora": run_lora, "spec": run_spec, "moe": run_moe, "gemma3": run_gemma3, "mla": run_mla,
        "image": run_image, "offload": run_offload}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the script end to end")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per scenario")
    ap.add_argument("--child", choices=SCENARIOS)
    ap.add_argument("--cfg")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(RUNS[args.child](json.loads(args.cfg))))
        return 0
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no CUDA device: run with --smoke for the script's CPU check")
        return 0
    device, dtype = ("cuda", "bfloat16") if cuda and not args.smoke else ("cpu", "float32")
    cfg = {"smoke": args.smoke, "device": device, "dtype": dtype, "prompt": 32 if args.smoke else 128,
           "output": 8 if args.smoke else 128, "streams": 4 if args.smoke else 64,
           "vocab": SHAPES["smoke" if args.smoke else "0.5b"]["vocab_size"], "max_len": 512}
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "cfg": cfg}
    for name in args.scenarios:
        cmd = [sys.executable, __file__, "--child", name, "--cfg", json.dumps(cfg)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            results[name] = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else \
                {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"did not finish in {args.timeout:.0f} s"}
        print(name, results[name], flush=True)
    RESULTS.mkdir(exist_ok=True)
    stem = "gpu_reach_bench_smoke" if args.smoke else "gpu_reach_bench"
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=2))
    lines = ["| scenario | figures |", "|---|---|"]
    lines += [f"| {k} | " + ", ".join(f"{m} {v:.3g}" if isinstance(v, float) else f"{m} {v}" for m, v in r.items())
              + " |" for k, r in results.items() if k in SCENARIOS]
    (RESULTS / f"{stem}.md").write_text(f"device: {results['device']}\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
