"""fp32 linear: runlm.kernels.linear vs torch F.linear (MKL), weights streamed from DRAM.

Each (N, K) gets enough distinct weight matrices that one pass over them is far larger than
the last-level cache (at least 24 of them and 256 MB; fewer only for the lm_head shapes, where
a few matrices already make 1 GB), and every timed call uses the next one, so each call reads
its weights from DRAM as in a real decode step.

    .venv/bin/python bench/gemm_bench.py                      # full table
    .venv/bin/python bench/gemm_bench.py --m 1 8 --model qwen --threads 2
    MKL_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python bench/gemm_bench.py   # MKL without AVX-512

GB/s counts the weight bytes only (N*K*4 per call); GFLOP/s is 2*M*N*K per call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runlm import kernels  # noqa: E402

SHAPES = {
    "qwen": [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864),
             ("lm_head", 151936, 896)],
    "smol": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
             ("lm_head", 49152, 576)],
}
MS = [1, 4, 8, 16, 32, 64, 128, 512]
MIN_COPIES = 24
MIN_POOL_BYTES = 256 << 20
MAX_POOL_BYTES = 1 << 30


def time_per_call(fn, weights, x, min_time: float, min_rounds: int, stat=statistics.median) -> float:
    """stat (median or min) over rounds of (one pass over all weight copies) / copies, in seconds."""
    for w in weights[: max(2, len(weights) // 4)]:  # warm-up: pages, threads, code
        fn(x, w)
    rounds: list[float] = []
    start = time.perf_counter()
    while len(rounds) < min_rounds or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        for w in weights:
            fn(x, w)
        rounds.append((time.perf_counter() - t0) / len(weights))
        if len(rounds) >= 50:
            break
    return stat(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=MS)
    ap.add_argument("--model", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--shape", nargs="+", help="only these layer names (qkv, o, gate_up, down, lm_head)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="minimum passes over the weights per measurement")
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="per-pass time reported (min is steadier on a noisy machine)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ok = kernels.available()
    print(f"runlm kernel available: {ok} (first use incl. compile or cache load: {time.perf_counter() - t0:.1f} s)")
    if not ok:
        sys.exit("kernel not available; nothing to compare")
    print(f"torch {torch.__version__}, {args.threads} threads, ATen CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, MKL_ENABLE_INSTRUCTIONS="
          f"{os.environ.get('MKL_ENABLE_INSTRUCTIONS', '(unset)')}, {args.stat} of passes")
    stat = statistics.median if args.stat == "median" else min
    print()
    hdr = (f"{'model':5} {'layer':8} {'N':>6} {'K':>5} {'M':>4} | {'ours us':>9} {'torch us':>9} {'speedup':>7} | "
           f"{'ours GB/s':>9} {'torch GB/s':>10} | {'ours GF/s':>9} {'torch GF/s':>10}")
    print(hdr)
    print("-" * len(hdr))
    models = list(SHAPES) if args.model == "all" else [args.model]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for model in models:
            for name, n, k in SHAPES[model]:
                if args.shape and name not in args.shape:
                    continue
                nbytes = n * k * 4
                if nbytes * MIN_COPIES <= MAX_POOL_BYTES:
                    copies = max(MIN_COPIES, -(-MIN_POOL_BYTES // nbytes))
                else:
                    copies = max(2, -(-MAX_POOL_BYTES // nbytes))
                weights = [torch.randn(n, k, generator=g) * k ** -0.5 for _ in range(copies)]
                for m in args.m:
                    x = torch.randn(m, k, generator=g)
                    ours = time_per_call(kernels.linear, weights, x, args.min_time, args.rounds, stat)
                    ref = time_per_call(F.linear, weights, x, args.min_time, args.rounds, stat)
                    flops = 2.0 * m * n * k
                    print(f"{model:5} {name:8} {n:6d} {k:5d} {m:4d} | {ours * 1e6:9.1f} {ref * 1e6:9.1f} "
                          f"{ref / ours:6.2f}x | {nbytes / ours / 1e9:9.1f} {nbytes / ref / 1e9:10.1f} | "
                          f"{flops / ours / 1e9:9.1f} {flops / ref / 1e9:10.1f}", flush=True)
                del weights


if __name__ == "__main__":
    main()
