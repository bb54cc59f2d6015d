"""Quantized GGUF files: runlm (fast and exact numerics) against llama.cpp, side by side.

Files: smollm2 (Q4_1, as shipped), the 0.5B-shape model (bench/models.py) written through llama.cpp's own
quantizer (``llama_cpp.llama_model_quantize``) as Q8_0, Q4_K_M and Q4_0, and the sizes people run on a
CPU (1.5B- and 3B-shaped Qwen2.5, 8B-shaped Llama 3.1: ``1.5b-q4_k_m``, ``3b-q8_0``...) quantized the same way.
Each file's bytes per block type, and each peer's decode speed as a share of the bandwidth limit (the
machine's read bandwidth, measured before each round and the median taken, over the bytes a step reads). For each
file and each peer, one child process per measurement, peers alternating round by round:
load seconds (to ready for the first token), time to first token and prefill tok/s on a
``--prompt-tokens`` prompt, single-stream greedy decode tok/s over ``--gen-tokens``, peak RSS.
KL divergence of the next-token distribution against runlm's exact mode, over ``--kl-positions``
positions of English text, for runlm's fast mode and for llama.cpp (``logits_all=True``).

Writes bench/results/quant_bench.json, a markdown table (ratio columns are runlm fast / llama.cpp)
and bench/results/quant_bench.png.

    .venv/bin/python bench/quant_bench.py [--files smollm2,q8_0,1.5b-q4_k_m] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
SHAPE = "qwen2.5-0.5b-shape"
# llama.cpp's file types (llama_ftype): what llama_model_quantize is asked to write
FTYPES = {"q8_0": 7, "q4_k_m": 15, "q4_0": 2}
PEERS = ("runlm-fast", "runlm-exact", "llamacpp")


# file keys: "q4_k_m" (the 0.5B shape) or "<size>-q4_k_m" for the shapes people run on a CPU
SIZES = {"1.5b": "qwen2.5-1.5b-shape", "3b": "qwen2.5-3b-shape", "8b": "llama3.1-8b-shape"}


def model_file(key: str) -> Path:
    """smollm2's shipped file, or a shape (bench/models.py) quantized by llama.cpp (built once, cached)."""
    from runlm.catalog import resolve_model

    if key == "smollm2":
        return Path(resolve_model("smollm2"))
    from bench.models import CACHE, build_gguf

    size, _, qtype = key.rpartition("-")
    shape = SIZES[size] if size else SHAPE
    target = CACHE / f"{shape}.{qtype}.gguf"
    return target if target.exists() else quantize(build_gguf(shape), target, qtype)


def quantize(source: Path, target: Path, key: str, requantize: bool = False) -> Path:
    """``source`` written by llama.cpp's own quantizer as ``key`` (q8_0, q4_k_m, q4_0); ``requantize``: the
    source is itself quantized (its values are dequantized, then quantized again)."""
    code = ("import sys, llama_cpp\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            f"p.ftype = {FTYPES[key]}\np.nthread = {os.cpu_count() or 2}\np.allow_requantize = {requantize}\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n")
    partial = target.with_suffix(".partial")
    subprocess.run([sys.executable, "-c", code, str(source), str(partial)], check=True,  # its own process:
                   capture_output=True)
    partial.rename(target)  # llama.cpp's ggml must not meet runlm's in one process
    return target


def read_bandwidth(threads: int, gib: int = 2) -> float:
    """This machine's read bandwidth in bytes/s at ``threads`` threads: the best of 5 torch sums over a
    buffer far larger than any cache (decode's limit: every weight byte is read once per token)."""
    import torch

    torch.set_num_threads(threads)
    buf = torch.ones(gib << 28, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def warm_page_cache(path: Path) -> None:
    """Read the file once before the rounds, so that the first peer of the first round does not read it from disk
    (runlm maps the file and faults pages in during its first prompt; llama.cpp reads it at load)."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def bytes_per_token(path: Path) -> tuple[int, dict[str, int]]:
    """The weight bytes a decode step reads (every tensor but an untied embedding's, of which it reads a row)
    and the file's bytes per block type."""
    from runlm.models.spec import read_spec

    spec = read_spec(path, find_projector=False)
    assert spec.gguf is not None
    tensors = spec.gguf.tensors
    untied = "output.weight" in tensors and "token_embd.weight" in tensors
    read = sum(t.n_bytes for name, t in tensors.items() if not (untied and name == "token_embd.weight"))
    return read, spec.bytes_by_type()


def prompt_ids(path: Path, n: int) -> list[int]:
    from runlm.formats.gguf import GGUFFile
    from runlm.formats.tokenizer import Tokenizer
    from runlm.models.evaluate import english_text

    ids = Tokenizer.from_gguf(GGUFFile(path)).encode(english_text())
    return ids[:n]


# ---- children: one measurement each ----------------------------------------------------------

def _peak_rss() -> int:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from the parent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_runlm(path: Path, ids: list[int], gen: int, threads: int, exact: bool) -> dict:
    from runlm.engine.core.detokenizer import DELTA
    from runlm.engine.llm import LLM
    from runlm.engine.types.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(path), max_num_seqs=1, threads=threads, exact_numerics=exact, max_model_len=2048)
    load_s = time.perf_counter() - t0
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True),
                       output_kind=DELTA)
    t0 = time.perf_counter()
    times: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            times += [time.perf_counter()] * len(out.outputs[0].token_ids)
    # which runner computed, and whether torch (~220 MiB of RSS by itself) was ever imported
    return {**_timings(load_s, len(ids), t0, times), "runner": "native" if engine.native else "torch",
            "torch_imported": "torch" in sys.modules}


def child_llamacpp(path: Path, ids: list[int], gen: int, threads: int) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(str(path), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    times: list[float] = []
    for n, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
        times.append(time.perf_counter())
        if n + 1 >= gen:
            break
    return _timings(load_s, len(ids), t0, times)


def _timings(load_s: float, prompt: int, t0: float, times: list[float]) -> dict:
    ttft = times[0] - t0
    decode_s = times[-1] - times[0]
    return {"load_s": load_s, "ttft_s": ttft, "prefill_tok_s": prompt / ttft,
            "decode_tok_s": (len(times) - 1) / decode_s if decode_s > 0 else float("nan"), "peak_rss": _peak_rss()}


WINDOW = 512  # positions per independent context, for runlm and llama.cpp alike


def child_llamacpp_logits(path: Path, ids: list[int], out: Path) -> None:
    """llama.cpp's logits at every position, one file per window (out/0.pt, out/1.pt, ...)."""
    import numpy as np
    import torch
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=WINDOW, n_batch=WINDOW, logits_all=True, verbose=False,
                n_threads=os.cpu_count() or 2)
    for i, start in enumerate(range(0, len(ids), WINDOW)):
        window = ids[start:start + WINDOW]
        llm.reset()
        llm.eval(window)
        torch.save(torch.from_numpy(np.array(llm.scores[:len(window)], dtype=np.float32)), out / f"{i}.pt")


def kl_divergences(path: Path, positions: int) -> dict:
    """Mean KL against runlm's exact mode: runlm fast, and llama.cpp (its logits from a child of its own),
    window by window so that no [positions, vocab] table is ever whole in memory."""
    import tempfile

    import torch

    from runlm.engine.runners.native import native_model
    from runlm.engine.types.config import EngineConfig
    from runlm.models.evaluate import all_logits, mean_kl, native_logits
    from runlm.models.load import load_decoder

    ids = prompt_ids(path, positions)
    exact_model = load_decoder(path, exact_numerics=True).model
    # fast mode as it serves: the native runner where it runs the file, else the torch model's fused path
    native = native_model(path, EngineConfig(model=str(path), max_model_len=WINDOW))

    def fast_logits(window: list[int]) -> torch.Tensor:
        return native_logits(native.model, window, WINDOW) if native is not None else all_logits(fast, window, WINDOW)

    fast = load_decoder(path).model if native is None else None
    sums = {"runlm-fast": 0.0, "llamacpp": 0.0, "runlm-fast_top1": 0.0, "llamacpp_top1": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, __file__, "--child", "llamacpp-logits", "--model", str(path), "--ids",
                        json.dumps(ids), "--out", tmp], check=True)
        for i, start in enumerate(range(0, len(ids), WINDOW)):
            window = ids[start:start + WINDOW]
            exact = all_logits(exact_model, window, WINDOW)
            for peer, logits in (("runlm-fast", fast_logits(window)),
                                 ("llamacpp", torch.load(Path(tmp) / f"{i}.pt"))):
                sums[peer] += mean_kl(exact, logits) * len(window)
                sums[f"{peer}_top1"] += float((exact.argmax(-1) == logits.argmax(-1)).float().sum())
    return {"positions": len(ids), "fast_runner": "torch" if native is None else "native",
            **{k: v / len(ids) for k, v in sums.items()}}


def _run_child(peer: str, path: Path, ids: list[int], args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--child", peer, "--model", str(path), "--ids", json.dumps(ids),
           "--gen-tokens", str(args.gen_tokens), "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{peer} on {path.name} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- the report ---------------------------------------------------------------------------------

METRICS = ("decode_tok_s", "prefill_tok_s", "ttft_s", "load_s", "peak_rss")


def table(results: dict) -> str:
    head = ("| file | peer | decode tok/s | of the bandwidth limit | prefill tok/s | TTFT ms | load s | peak RSS MB "
            "| KL vs exact |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for key, r in results.items():
        limit = r["bandwidth"] / r["read_bytes"]  # tokens/s if every step only read the weights at full speed
        for peer in PEERS:
            m = r["median"].get(peer)
            if not m:
                continue
            kl = r.get("kl", {}).get(peer)
            lines.append(f"| {key} | {peer} | {m['decode_tok_s']:.1f} | {m['decode_tok_s'] / limit:.0%} of "
                         f"{limit:.1f} | {m['prefill_tok_s']:.0f} | {1e3 * m['ttft_s']:.0f} | {m['load_s']:.2f} | "
                         f"{m['peak_rss'] / 1e6:.0f} | {'' if kl is None else f'{kl:.5f}'} |")
    lines += ["", "| file | bytes a step reads | by block type |", "|---|---|---|"]
    for key, r in results.items():
        total = sum(r["bytes_by_type"].values())
        mix = ", ".join(f"{t} {b / total:.0%}" for t, b in sorted(r["bytes_by_type"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {key} | {r['read_bytes'] / 1e9:.2f} GB | {mix} |")
    lines += ["", "| file | decode | prefill | TTFT | load | peak RSS | KL | (runlm fast / llama.cpp) |",
              "|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        a, b = r["median"].get("runlm-fast"), r["median"].get("llamacpp")
        if not (a and b):
            continue
        kl = r.get("kl", {})
        kl_ratio = f"{kl['runlm-fast'] / kl['llamacpp']:.2f}x" if kl.get("llamacpp") else ""
        lines.append(f"| {key} | {a['decode_tok_s'] / b['decode_tok_s']:.2f}x | "
                     f"{a['prefill_tok_s'] / b['prefill_tok_s']:.2f}x | {a['ttft_s'] / b['ttft_s']:.2f}x | "
                     f"{a['load_s'] / b['load_s']:.2f}x | "
                     f"{a['peak_rss'] / b['peak_rss']:.2f}x | {kl_ratio} | |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, metric, label in zip(axes, ("decode_tok_s", "prefill_tok_s", "peak_rss"),
                                 ("decode tok/s", "prefill tok/s", "peak RSS (MB)")):
        for i, peer in enumerate(PEERS):
            vals = [results[f]["median"].get(peer, {}).get(metric, 0) / (1e6 if metric == "peak_rss" else 1)
                    for f in files]
            ax.bar([x + 0.27 * (i - 1) for x in range(len(files))], vals, width=0.27, label=peer)
        ax.set_xticks(range(len(files)), files)
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"runlm vs llama.cpp on GGUF files ({cpu_name()}, {os.cpu_count()} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags"))
        simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni") if f in flags]
        return f"{name}, {'/'.join(simd) or 'no AVX2'}"
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="smollm2,q8_0,q4_k_m,q4_0,1.5b-q4_k_m,1.5b-q8_0,3b-q4_k_m,8b-q4_k_m",
                    help="smollm2, the 0.5B shape's q8_0/q4_k_m/q4_0, or SIZE-TYPE with SIZE one of "
                         f"{'/'.join(SIZES)} (built and quantized on first use, cached under .cache/bench-models)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--kl-positions", type=int, default=4096, help="0 skips the KL measurement")
    ap.add_argument("--kl-sizes", action="store_true",
                    help="the KL of the SIZE-TYPE files too (runlm's exact mode holds them in fp32: 6 GB at 1.5B)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--skip-exact", action="store_true", help="measure runlm's fast mode and llama.cpp only")
    # child modes
    ap.add_argument("--child", choices=[*PEERS, "llamacpp-logits", "kl"])
    ap.add_argument("--positions", type=int)
    ap.add_argument("--model")
    ap.add_argument("--ids")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        path, ids = Path(args.model), json.loads(args.ids or "[]")
        if args.child == "llamacpp-logits":
            child_llamacpp_logits(path, ids, Path(args.out))
            return
        if args.child == "kl":
            print(json.dumps(kl_divergences(path, args.positions)))
            return
        res = (child_llamacpp(path, ids, args.gen_tokens, args.threads) if args.child == "llamacpp" else
               child_runlm(path, ids, args.gen_tokens, args.threads, exact=args.child == "runlm-exact"))
        print(json.dumps(res))
        return

    peers = [p for p in PEERS if not (args.skip_exact and p == "runlm-exact")]
    from runlm import kernels
    from runlm.kernels import fused, ggml
    from runlm.native import kernels as native

    kernels.available(), kernels.attention_available(), fused.available(), ggml.available()  # build once, here
    native.available()
    results: dict[str, dict] = {}
    bandwidth = read_bandwidth(args.threads)
    print(f"CPU: {cpu_name()}; {args.threads} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    for key in args.files.split(","):
        path = model_file(key)
        ids = prompt_ids(path, args.prompt_tokens)
        read_bytes, by_type = bytes_per_token(path)
        warm_page_cache(path)
        runs: dict[str, list[dict]] = {p: [] for p in peers}
        measured: list[float] = []  # the bandwidth before each round: a shared host's drifts by 2x within minutes
        for r in range(args.rounds):
            measured.append(read_bandwidth(args.threads))
            for peer in peers:
                res = _run_child(peer, path, ids, args)
                runs[peer].append(res)
                print(f"{key:8s} round {r + 1} {peer:12s} decode {res['decode_tok_s']:6.1f} tok/s  prefill "
                      f"{res['prefill_tok_s']:6.0f} tok/s  ttft {1e3 * res['ttft_s']:6.0f} ms  "
                      f"load {res['load_s']:5.2f} s  rss {res['peak_rss'] / 1e6:6.0f} MB"
                      + (f"  ({res['runner']} runner, torch {'imported' if res['torch_imported'] else 'not imported'})"
                         if "runner" in res else ""), flush=True)
        median = {p: {m: statistics.median(x[m] for x in v) for m in METRICS} for p, v in runs.items()}
        results[key] = {"file": str(path), "size_bytes": path.stat().st_size, "read_bytes": read_bytes,
                        "bytes_by_type": by_type, "bandwidth": statistics.median(measured),
                        "bandwidth_rounds": measured, "runs": runs, "median": median}
        print(f"{key:8s} read bandwidth before each round: "
              f"{', '.join(f'{b / 1e9:.1f}' for b in measured)} GB/s", flush=True)
        if args.kl_positions and (args.kl_sizes or "-" not in key):
            out = subprocess.run([sys.executable, __file__, "--child", "kl", "--model", str(path), "--positions",
                                  str(args.kl_positions)], capture_output=True, text=True, check=True)
            results[key]["kl"] = kl = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{key:8s} KL vs exact over {kl['positions']} positions: runlm fast {kl['runlm-fast']:.5f}, "
                  f"llama.cpp {kl['llamacpp']:.5f}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    report = table(results)
    print(f"\nCPU: {cpu_name()}; {args.threads} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s at start (each "
          f"file's limit: the median of its rounds' measurements)\n\n{report}")
    (RESULTS / "quant_bench.json").write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads,
                                                          "bandwidth": bandwidth,
                                                          "args": vars(args), "results": results}, indent=2))
    (RESULTS / "quant_bench.md").write_text(report + "\n")
    plot(results, RESULTS / "quant_bench.png")


if __name__ == "__main__":
    main()
