"""Engine benchmark: runlm vs HF transformers vs llama-cpp-python on the same weights.

For each model: single-stream decode tok/s, time to first token, prefill tok/s, and aggregate
output tok/s at 1/8/32 concurrent requests (128 prompt / 128 output tokens, ignore_eos).
Every measurement runs in a child process of its own (thread pools and OpenMP settings of one
peer never touch another); peers alternate inside each round. llama-cpp-python's Python API
runs one sequence at a time, so its aggregate figure is requests served one after another.

    .venv/bin/python bench/engine_bench.py [--models smollm2 qwen2.5-0.5b-shape] [--rounds 1]

Writes bench/results/engine_bench.json, engine_bench.md and engine_bench.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
PROMPT_LEN, OUTPUT_LEN, PREFILL_LEN = 128, 128, 512
CONCURRENCY = (1, 8, 32)
PEERS = ("runlm", "hf", "llamacpp")


def model_files(model: str) -> dict[str, str]:
    """runlm/hf read `weights` (gguf or safetensors dir); llama.cpp reads `gguf`. A path to a .gguf file
    (e.g. one bench/quant_bench.py wrote) is read by every peer."""
    if model.endswith(".gguf") and Path(model).is_file():
        return {"weights": model, "gguf": model}
    if model == "smollm2":
        from runlm.catalog import resolve_model

        path = str(resolve_model("smollm2"))
        return {"weights": path, "gguf": path}
    from bench.models import build_gguf, build_safetensors

    return {"weights": str(build_safetensors(model)), "gguf": str(build_gguf(model))}


def prompts(n: int, length: int, vocab: int = 49152) -> list[list[int]]:
    import random

    rng = random.Random(n * 1000 + length)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def single_stream_figures(stream) -> dict:
    """stream(prompt_ids, new_tokens) -> a timestamp per generated token; TTFT, decode and prefill rates."""
    t0 = time.perf_counter()
    times = stream(prompts(1, PROMPT_LEN)[0], OUTPUT_LEN)
    res = {"ttft_s": times[0] - t0, "decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}
    t0 = time.perf_counter()
    times = stream(prompts(1, PREFILL_LEN)[0], 1)
    res["prefill_tok_s"] = PREFILL_LEN / (times[0] - t0)
    return res


# ---- peers (each runs inside its own child process) -----------------------------------------
def run_runlm(files: dict[str, str], threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from runlm.engine.core.detokenizer import DELTA
    from runlm.engine.llm import LLM
    from runlm.engine.types.sampling_params import SamplingParams

    llm = LLM(files["weights"], max_num_seqs=max(CONCURRENCY), max_model_len=1024, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts(1, 16)[0]}], SamplingParams(max_tokens=4))  # warm-up

    def stream(ids: list[int], max_tokens: int) -> list[float]:
        engine.add_request("s", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                          ignore_eos=True), output_kind=DELTA)
        times = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                times += [time.perf_counter()] * len(out.outputs[0].token_ids)
        return times

    res = single_stream_figures(stream)
    for n in CONCURRENCY:
        batch = [{"prompt_token_ids": p} for p in prompts(n, PROMPT_LEN)]
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        res[f"aggregate_{n}_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    return res


def run_hf(files: dict[str, str], threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    path = Path(files["weights"])
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()

    def generate(batch: list[list[int]], new: int) -> list[float]:
        """Per-token timestamps of a batched greedy generate (a streamer marks each step)."""
        times: list[float] = []

        class Clock:
            def put(self, _value):
                times.append(time.perf_counter())

            def end(self):
                pass

        ids = torch.tensor(batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0, streamer=Clock() if len(batch) == 1 else None)
        return times

    generate(prompts(1, 16), 4)  # warm-up
    res = {}
    t0 = time.perf_counter()
    times = generate(prompts(1, PROMPT_LEN), OUTPUT_LEN)[1:]  # the streamer sees the prompt first
    res["ttft_s"] = times[0] - t0
    res["decode_tok_s"] = (len(times) - 1) / (times[-1] - times[0])
    t0 = time.perf_counter()
    generate(prompts(1, PREFILL_LEN), 1)
    res["prefill_tok_s"] = PREFILL_LEN / (time.perf_counter() - t0)
    for n in CONCURRENCY:
        t0 = time.perf_counter()
        generate(prompts(n, PROMPT_LEN), OUTPUT_LEN)
        res[f"aggregate_{n}_tok_s"] = n * OUTPUT_LEN / (time.perf_counter() - t0)
    return res


def run_llamacpp(files: dict[str, str], threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(files["gguf"], n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)

    def stream(ids: list[int], new: int) -> list[float]:
        times = []
        for n, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
            times.append(time.perf_counter())
            if n + 1 >= new:
                break
        return times

    stream(prompts(1, 16)[0], 4)  # warm-up
    res = single_stream_figures(stream)
    for n in CONCURRENCY:  # one at a time; at most 2 requests timed, the rate is the same for more
        served = min(n, 2)
        t0 = time.perf_counter()
        for p in prompts(served, PROMPT_LEN):
            stream(p, OUTPUT_LEN)
        res[f"aggregate_{n}_tok_s"] = served * OUTPUT_LEN / (time.perf_counter() - t0)
    return res


# ---- driver ---------------------------------------------------------------------------------
def child(peer: str, model: str, threads: int) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT))
    cmd = [sys.executable, __file__, "--child", peer, "--models", model, "--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


METRICS = ["decode_tok_s", "ttft_s", "prefill_tok_s"] + [f"aggregate_{n}_tok_s" for n in CONCURRENCY]


def summarize(runs: dict) -> dict:
    out = {}
    for model, peers in runs.items():
        out[model] = {}
        for peer, rs in peers.items():
            ok = [r for r in rs if "error" not in r]
            out[model][peer] = {m: statistics.median(r[m] for r in ok) for m in METRICS} if ok else \
                {"error": rs[-1]["error"]}
    return out


def table(summary: dict) -> str:
    lines = ["| model | metric | runlm | HF transformers | llama.cpp | runlm / HF | runlm / llama.cpp |",
             "|---|---|---|---|---|---|---|"]
    for model, peers in summary.items():
        for m in METRICS:
            vals = [peers.get(p, {}).get(m) for p in PEERS]

            def fmt(v, m=m):  # called in this iteration; bound so the closure says so
                return "—" if v is None else (f"{v * 1000:.0f} ms" if m == "ttft_s" else f"{v:.1f}")

            def ratio(a, b, m=m):
                if a is None or b is None:
                    return "—"
                return f"{(b / a if m == 'ttft_s' else a / b):.2f}x"

            lines.append(f"| {model} | {m} | {fmt(vals[0])} | {fmt(vals[1])} | {fmt(vals[2])} | "
                         f"{ratio(vals[0], vals[1])} | {ratio(vals[0], vals[2])} |")
    return "\n".join(lines) + "\n\n(ttft ratios are peer ÷ runlm, so > 1 means runlm is faster everywhere.)\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4), squeeze=False)
    for ax, (model, peers) in zip(axes[0], summary.items()):
        for peer in PEERS:
            vals = [peers.get(peer, {}).get(f"aggregate_{n}_tok_s") for n in CONCURRENCY]
            if all(v is not None for v in vals):
                ax.plot(CONCURRENCY, vals, marker="o", label=peer)
        ax.set_xscale("log", base=2)
        ax.set_xticks(CONCURRENCY, [str(n) for n in CONCURRENCY])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.set_title(model)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen2.5-0.5b-shape"])
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--child", choices=PEERS)
    args = ap.parse_args()
    if args.child:
        files = model_files(args.models[0])
        print(json.dumps({"runlm": run_runlm, "hf": run_hf, "llamacpp": run_llamacpp}[args.child](files, args.threads)))
        return
    runs: dict = {m: {p: [] for p in args.peers} for m in args.models}
    for model in args.models:
        model_files(model)  # build once, outside the timed children
        for r in range(args.rounds):
            for peer in args.peers:
                res = child(peer, model, args.threads)
                runs[model][peer].append(res)
                print(f"{model} round {r + 1} {peer}: {res}", flush=True)
    summary = summarize(runs)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine_bench.json").write_text(json.dumps({"runs": runs, "summary": summary,
                                                           "threads": args.threads}, indent=2))
    md = table(summary)
    (RESULTS / "engine_bench.md").write_text(md)
    plot(summary, RESULTS / "engine_bench.png")
    print("\n" + md)


if __name__ == "__main__":
    main()
