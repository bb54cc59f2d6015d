"""GPU benchmark (issue 28): runlm's GPU runner vs transformers (and vLLM where installed) on the same model.

Random-weight Qwen2.5-0.5B-, 1.5B- and 7B-shaped models (49,152-token vocabulary, as the issue's baseline) are
built on the device in bf16 and saved as safetensors with a byte-level BPE tokenizer without merges (no hub, no
package index); runlm also runs the same shape as a Q4_K_M GGUF (runlm's converter and quantizer: its blocks kept on
the device). Every peer then loads its files in a child process of its own and is measured on the same prompts
(random token ids, PROMPT_LEN in, OUTPUT_LEN out, greedy, ignore_eos):

- load: from the files to ready (runlm: LLM(...) including graph capture and the memory profile), cold (an empty
  Triton cache: every kernel compiled) and warm (a second process on the cache the first left);
- 1 stream: decode tok/s after the first token, and TTFT; TTFT of a 2,048-token prompt (--long-prompt);
- kernels a decode step (runlm on CUDA: torch.profiler over 8 steps of one sequence, sampler included);
- 8 / 64 / 256 concurrent requests: output tok/s (all output tokens / wall time);
- limit: the bandwidth limit of one stream, weight bytes per step / the card's memory bandwidth.

transformers: ``generate`` for one stream, its paged continuous batching (``generate_batch``) for the
concurrent runs. vLLM: ``vllm.LLM`` where importable.

    python bench/gpu_bench.py [--models 0.5b 1.5b 7b] [--peers runlm hf vllm]   # needs CUDA (skips without)
    python bench/gpu_bench.py --smoke    # tiny shapes on the CPU: checks the script end to end, no figures

``--waiting-steps`` adds runlm with async scheduling off (each step waited for before the next is scheduled), so
the table shows what queuing the next step while the last one runs buys; ``--fp8-kv`` adds the fp8 KV cache.

Writes bench/results/gpu_bench.json and gpu_bench.md (``--smoke``: gpu_bench_smoke.*).
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
RESULTS = ROOT / "bench" / "results"
CACHE = Path(os.environ.get("RUNLM_BENCH_CACHE", ROOT / ".cache" / "bench-models"))
VOCAB = 49152

_QWEN = dict(rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, bos_token_id=1,
             eos_token_id=2, vocab_size=VOCAB)
SHAPES = {
    "0.5b": dict(_QWEN, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, tie_word_embeddings=True),
    "1.5b": dict(_QWEN, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, tie_word_embeddings=True),
    "7b": dict(_QWEN, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, tie_word_embeddings=False),
    "smoke": dict(_QWEN, vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                  tie_word_embeddings=True),
}
# memory bandwidth by device name (bytes/s): the limit column
BANDWIDTH = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12,
             "L40S": 0.864e12, "L4": 0.3e12}


def _tokenizer(target: Path, vocab: int) -> None:
    """A byte-level BPE over ``vocab`` tokens without merges (the 256 bytes, then made-up words): the benchmark feeds
    token ids, the engine needs a tokenizer, and runlm's GGUF converter reads byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    words = sorted(alphabet) + [f"t{i}" for i in range(vocab - len(alphabet))]
    tok = Tokenizer(models.BPE({w: i for i, w in enumerate(words)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({"eos_token": words[2], "bos_token": words[1]}))


def build_model(shape: str, device: str, dtype: str) -> Path:
    """The shape's random weights, made on the device and saved as safetensors (cached by shape and dtype)."""
    target = CACHE / f"gpu-qwen2.5-{shape}-{dtype}"
    if (target / "model.safetensors").exists() or (target / "model.safetensors.index.json").exists():
        return target
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape])).to(getattr(torch, dtype))
    tmp = target.with_name(target.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    _tokenizer(tmp, SHAPES[shape]["vocab_size"])
    del model
    os.replace(tmp, target)
    return target


def gguf_of(directory: Path, qtype: str) -> Path:
    """The shape's directory as a GGUF file in ``qtype`` (runlm's converter to F16, then its quantizer: llama.cpp's
    per-tensor choices), cached beside it."""
    from runlm.quantize import quantize_file
    from runlm.quantize.convert import convert_folder

    target = directory.with_name(f"{directory.name}-{qtype.lower()}.gguf")
    if not target.exists():
        f16 = directory.with_name(directory.name + "-f16.gguf")
        convert_folder(directory, f16, "f16")
        quantize_file(f16, target.with_suffix(".partial"), qtype)
        f16.unlink()
        os.replace(target.with_suffix(".partial"), target)
    return target


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed * 7919 + n)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# ---- peers, each in a child process ---------------------------------------------------------------------------
def run_runlm(path: str, cfg: dict) -> dict:
    os.environ["RUNLM_GPU_RUNNER"] = "1"
    from runlm.engine.llm import LLM
    from runlm.engine.types.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(path, device=cfg["device"], dtype=cfg["dtype"], max_num_seqs=max(cfg["concurrency"]),
              max_num_batched_tokens=cfg["batched_tokens"],
              max_model_len=max(cfg["prompt"], cfg["long_prompt"]) + cfg["output"] + 16,
              kv_cache_dtype=cfg.get("kv_cache_dtype", "auto"), async_scheduling=cfg.get("async_scheduling", True),
              **({"kv_cache_memory": "64MiB"} if cfg["device"] == "cpu" else {}))
    _sync(cfg["device"])
    out: dict = {"load_s": time.perf_counter() - t0}
    if cfg.get("load_only"):
        return out
    params = SamplingParams(temperature=0.0, max_tokens=cfg["output"], ignore_eos=True)
    engine = llm.engine
    vocab = SHAPES[cfg["shape"]]["vocab_size"]
    llm.generate([{"prompt_token_ids": p} for p in prompts(2, cfg["prompt"], vocab, 99)], params, use_tqdm=False)
    engine.add_request("one", {"prompt_token_ids": prompts(1, cfg["prompt"], vocab)[0]}, params)
    t0, times = time.perf_counter(), []
    while engine.has_unfinished_requests():
        for o in engine.step():
            n = len(o.outputs[0].token_ids)
            times += [time.perf_counter()] * (n - len(times))
    out["ttft_s"] = times[0] - t0
    out["tok_s_1"] = (len(times) - 1) / (times[-1] - times[0])
    out["kernels_per_step"] = kernels_per_decode_step(engine, vocab, cfg)
    long = [{"prompt_token_ids": prompts(1, cfg["long_prompt"], vocab, 5)[0]}]
    t0 = time.perf_counter()
    llm.generate(long, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    out["ttft_long_s"] = time.perf_counter() - t0
    for c in cfg["concurrency"]:
        batch = [{"prompt_token_ids": p} for p in prompts(c, cfg["prompt"], vocab, 1)]
        t0 = time.perf_counter()
        res = llm.generate(batch, params, use_tqdm=False)
        out[f"tok_s_{c}"] = sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t0)
    out["graphs"] = sorted(getattr(engine.runner, "graphs", {}))
    return out


def kernels_per_decode_step(engine, vocab: int, cfg: dict) -> float | None:
    """CUDA kernels a decode step of one sequence runs (torch.profiler over 8 steps, graph replays included: the
    kernels inside a graph count), sampler and output building included; None off CUDA."""
    if not cfg["device"].startswith("cuda"):
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    from runlm.engine.types.sampling_params import SamplingParams

    engine.add_request("profiled", {"prompt_token_ids": prompts(1, cfg["prompt"], vocab, 3)[0]},
                       SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    for _ in range(4):  # the prefill, then decodes
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            engine.step()
        torch.cuda.synchronize()
    engine.abort_request("profiled")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    return len(kernels) / 8


def run_hf(path: str, cfg: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = getattr(torch, cfg["dtype"])
    t0 = time.perf_counter()
    try:  # straight to the device where transformers can
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=cfg["device"]).eval()
    except (ImportError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(cfg["device"]).eval()
    _sync(cfg["device"])
    out: dict = {"load_s": time.perf_counter() - t0}
    vocab = SHAPES[cfg["shape"]]["vocab_size"]
    ids = torch.tensor([prompts(1, cfg["prompt"], vocab)[0]], device=cfg["device"])
    gen = dict(do_sample=False, max_new_tokens=cfg["output"], min_new_tokens=cfg["output"], pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**gen, "max_new_tokens": 2, "min_new_tokens": 2})
        _sync(cfg["device"])
        t0 = time.perf_counter()
        model.generate(ids, **{**gen, "max_new_tokens": 1, "min_new_tokens": 1})
        _sync(cfg["device"])
        out["ttft_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, **gen)
        _sync(cfg["device"])
        total = time.perf_counter() - t0
        out["tok_s_1"] = (cfg["output"] - 1) / max(total - out["ttft_s"], 1e-9)
    for c in cfg["concurrency"]:
        batch = prompts(c, cfg["prompt"], vocab, 1)
        try:
            config = GenerationConfig(max_new_tokens=cfg["output"], do_sample=False, eos_token_id=-1,
                                      pad_token_id=0)
            t0 = time.perf_counter()
            res = model.generate_batch(inputs=batch, generation_config=config)
            _sync(cfg["device"])
            made = sum(len(getattr(r, "generated_tokens", []) or []) for r in res.values())
            out[f"tok_s_{c}"] = made / (time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - an API that moved, or no paged attention on this device
            out[f"tok_s_{c}"] = None
            out.setdefault("errors", []).append(f"generate_batch x{c}: {type(exc).__name__}: {exc}"[:300])
    return out


def run_vllm(path: str, cfg: dict) -> dict:
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    t0 = time.perf_counter()
    llm = LLM(path, dtype=cfg["dtype"], max_num_seqs=max(cfg["concurrency"]),
              max_model_len=cfg["prompt"] + cfg["output"] + 16)
    out: dict = {"load_s": time.perf_counter() - t0}
    vocab = SHAPES[cfg["shape"]]["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=cfg["output"], ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompts(1, cfg["prompt"], vocab)[0]}],
                 SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    out["ttft_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompts(1, cfg["prompt"], vocab)[0]}], params, use_tqdm=False)
    out["tok_s_1"] = (cfg["output"] - 1) / max(time.perf_counter() - t0 - out["ttft_s"], 1e-9)
    for c in cfg["concurrency"]:
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in prompts(c, cfg["prompt"], vocab, 1)], params,
                           use_tqdm=False)
        out[f"tok_s_{c}"] = sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t0)
    return out


PEERS = {"runlm": run_runlm, "hf": run_hf, "vllm": run_vllm}


def child(peer: str, path: Path, cfg: dict, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", peer, "--path", str(path), "--cfg", json.dumps(cfg)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def runlm_cold_and_warm(path: Path, cfg: dict, timeout: float) -> dict:
    """runlm's figures with a fresh Triton cache (its load compiles every kernel: cold), then one more load with
    the cache that run left (warm)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="runlm-triton-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            figures = child("runlm", path, cfg, timeout)
            if "error" not in figures:
                figures["load_warm_s"] = child("runlm", path, {**cfg, "load_only": True}, timeout).get("load_s")
        finally:
            del os.environ["TRITON_CACHE_DIR"]
    return figures


def weight_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))


def limit_tok_s(path: Path, device: str) -> float | None:
    """One stream's bandwidth limit: every weight read once per token."""
    if not device.startswith("cuda"):
        return None
    import torch

    name = torch.cuda.get_device_name()
    bw = next((b for key, b in BANDWIDTH.items() if key in name), None)
    return bw / weight_bytes(path) if bw else None


def table(results: list[dict], concurrency: list[int]) -> str:
    cols = ["model", "peer", "load s (cold/warm)", "TTFT ms", "TTFT ms, long prompt", "kernels a decode step",
            "1 stream tok/s", *[f"{c} streams tok/s" for c in concurrency], "limit 1 stream tok/s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def f(x, scale: float = 1.0, digits: int = 1) -> str:
        return "" if x is None else f"{x * scale:,.{digits}f}"

    for r in results:
        m = r["figures"]
        if "error" in m:
            lines.append(f"| {r['model']} | {r['peer']} | {m['error']} |" + " |" * (len(cols) - 3))
            continue
        load = f(m.get("load_s"), digits=2) + (f" / {m['load_warm_s']:.2f}" if m.get("load_warm_s") else "")
        lines.append("| " + " | ".join([r["model"], r["peer"], load, f(m.get("ttft_s"), 1000),
                                        f(m.get("ttft_long_s"), 1000), f(m.get("kernels_per_step"), digits=0),
                                        f(m.get("tok_s_1")),
                                        *[f(m.get(f"tok_s_{c}")) for c in concurrency],
                                        f(r.get("limit_tok_s"), digits=0)]) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["0.5b", "1.5b", "7b"], choices=[s for s in SHAPES if s != "smoke"])
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--long-prompt", type=int, default=2048, help="the prompt of the second TTFT column")
    ap.add_argument("--gguf", default="Q4_K_M", help="runlm also on the shape as this GGUF type ('' for none)")
    ap.add_argument("--fp8-kv", action="store_true", help="runlm also with --kv-cache-dtype fp8 (the bf16 weights)")
    ap.add_argument("--waiting-steps", action="store_true",
                    help="runlm also with --no-async-scheduling (each step waited for: what the overlap buys)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per peer and model")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the script end to end")
    ap.add_argument("--child", choices=list(PEERS))
    ap.add_argument("--path")
    ap.add_argument("--cfg")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(PEERS[args.child](args.path, json.loads(args.cfg))))
        return 0
    if args.smoke:
        device, dtype, models = "cpu", "float32", ["smoke"]
        args.prompt, args.output, args.concurrency, args.long_prompt = 16, 6, [2, 4], 64
        peers = [p for p in args.peers if p != "vllm"]
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_bench: skipped (no CUDA device; --smoke checks the script on the CPU)")
            return 0
        device, dtype, models, peers = "cuda", "bfloat16", args.models, args.peers
        if "vllm" in peers:
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                peers = [p for p in peers if p != "vllm"]
    results = []
    for model in models:
        path = build_model(model, device, dtype)
        cfg = dict(shape=model, device=device, dtype=dtype, prompt=args.prompt, output=args.output,
                   concurrency=args.concurrency, batched_tokens=2048 if device == "cuda" else 64,
                   long_prompt=args.long_prompt)
        runs = [(peer, path) for peer in peers]
        if args.gguf and "runlm" in peers:
            try:
                runs.append((f"runlm {args.gguf}", gguf_of(path, args.gguf)))
            except Exception as exc:  # noqa: BLE001 - no gguf package or ggml quantizer on this machine
                results.append({"model": model, "peer": f"runlm {args.gguf}",
                                "figures": {"error": f"no {args.gguf} file: {exc}"[:300]}})
        variants = {"runlm fp8 KV cache": dict(cfg, kv_cache_dtype="fp8"),
                    "runlm waiting steps": dict(cfg, async_scheduling=False)}
        if args.fp8_kv and "runlm" in peers:
            runs.append(("runlm fp8 KV cache", path))
        if args.waiting_steps and "runlm" in peers:
            runs.append(("runlm waiting steps", path))
        for peer, weights in runs:
            run_cfg = variants.get(peer, cfg)
            figures = runlm_cold_and_warm(weights, run_cfg, args.timeout) if peer.startswith("runlm") else \
                child(peer, weights, cfg, args.timeout)
            print(model, peer, json.dumps(figures), flush=True)
            results.append({"model": model, "peer": peer, "figures": figures,
                            "limit_tok_s": limit_tok_s(weights, device), "weight_bytes": weight_bytes(weights)})
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "gpu_bench_smoke" if args.smoke else "gpu_bench"
    meta = {"device": device, "dtype": dtype, "prompt": args.prompt, "output": args.output,
            "concurrency": args.concurrency}
    if device == "cuda":
        import torch

        meta["gpu"] = torch.cuda.get_device_name()
        meta["torch"] = torch.__version__
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    md = table(results, args.concurrency)
    (RESULTS / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
