"""Data-parallel benchmark: aggregate output tok/s at a fixed concurrency with 1 vs N replicas.

Each configuration is an ``AsyncLLM(model, data_parallel_size=n, threads=n * threads_per_replica)``:
every replica is a child process (``--backend mp``) or a Ray actor (``--backend ray``, on the cluster
at ``--ray-address``) with ``--threads-per-replica`` threads. The same prompts (random token ids,
``--prompt-len`` long) are sent ``--concurrency`` at a time, ``--output-len`` tokens each
(ignore_eos), after one warm-up request per replica; the figure is generated tokens over wall time.
Configurations run one after another in this process (replicas are processes of their own).

    .venv/bin/python bench/dp_bench.py [--model smollm2] [--replicas 1 2] [--concurrency 32]
        [--output-len 64] [--threads-per-replica 1] [--backend mp|ray] [--ray-address auto]

Prints a markdown table and writes bench/results/dp_bench.json. On a 2-core machine two one-thread
replicas use both cores where one does not; on a machine with more cores raise --replicas.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"


def prompts(n: int, length: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(n * 1000 + length)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


async def measure(llm, args: argparse.Namespace) -> dict:
    from runlm.engine.types.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for rank in sorted(llm.replicas):  # warm-up: every replica has run once before the clock starts
        async for _ in llm.generate({"prompt_token_ids": prompts(1, 8)[0]},
                                    SamplingParams(max_tokens=2, ignore_eos=True), data_parallel_rank=rank):
            pass
    work = prompts(args.requests, args.prompt_len)
    gate = asyncio.Semaphore(args.concurrency)
    tokens = 0

    async def one(prompt: list[int]) -> None:
        nonlocal tokens
        async with gate:
            async for out in llm.generate({"prompt_token_ids": prompt}, params):
                tokens += len(out.outputs[0].token_ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in work))
    wall = time.perf_counter() - t0
    return {"requests": len(work), "output_tokens": tokens, "wall_s": round(wall, 2),
            "out_tok_s": round(tokens / wall, 2)}


def run_config(model: str, n: int, args: argparse.Namespace) -> dict:
    from runlm.engine.async_llm import AsyncLLM

    t0 = time.perf_counter()
    llm = AsyncLLM(model, data_parallel_size=n, distributed_executor_backend=args.backend,
                   ray_address=args.ray_address, threads=n * args.threads_per_replica,
                   max_num_seqs=args.concurrency)
    try:
        startup = time.perf_counter() - t0
        return {"replicas": n, "backend": args.backend, "threads_per_replica": args.threads_per_replica,
                "startup_s": round(startup, 1), **asyncio.run(measure(llm, args))}
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--backend", choices=("mp", "ray"), default="mp")
    ap.add_argument("--ray-address", default="auto")
    ap.add_argument("--threads-per-replica", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=None, help="requests in all (default: 2 x concurrency)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "dp_bench.json"))
    args = ap.parse_args()
    args.requests = args.requests or 2 * args.concurrency
    rows = [run_config(args.model, n, args) for n in args.replicas]
    base = rows[0]["out_tok_s"]
    print(f"\n{args.model}, {args.backend}, concurrency {args.concurrency}, {args.prompt_len} prompt / "
          f"{args.output_len} output tokens, {args.threads_per_replica} thread(s) per replica, "
          f"{os.cpu_count()} CPUs\n")
    print("| replicas | out tok/s | vs first | wall s | start-up s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['replicas']} | {r['out_tok_s']} | {r['out_tok_s'] / base:.2f}x | {r['wall_s']} | "
              f"{r['startup_s']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "out"},
                                          "rows": rows}, indent=2))


if __name__ == "__main__":  # replicas are spawned processes: they import this file without running it
    main()
