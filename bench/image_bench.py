"""Seconds per image through runlm's serving path vs calling diffusers directly, on the same pipeline.

Direct: ``DiffusionPipeline.from_pretrained`` in this process, ``pipe(prompt, ...)`` and the PNG
written to memory (what a diffusers user does to get a file). Served: ``runlm serve`` in a child
process with the pipeline in its store, its diffusers backend in a grandchild, the official
``openai`` client's ``images.generate`` (HTTP to the daemon, Unix socket to the backend, PNG and
base64 both ways). Same seed, size, steps and torch threads; the two alternate round by round and
never run at once. The pipeline is the tests' tiny random-weight one unless --pipeline names another.

    .venv/bin/python bench/image_bench.py [--pipeline DIR] [--size 64x64] [--steps 20] [--images 8] [--rounds 3]

Writes bench/results/image_bench.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def direct_seconds(pipe, args: argparse.Namespace, width: int, height: int) -> float:
    import torch

    t0 = time.perf_counter()
    for i in range(args.images):
        image = pipe(args.prompt, num_inference_steps=args.steps, width=width, height=height,
                     generator=torch.Generator("cpu").manual_seed(i)).images[0]
        image.save(io.BytesIO(), format="PNG")
    return (time.perf_counter() - t0) / args.images


def served_seconds(client, args: argparse.Namespace) -> float:
    t0 = time.perf_counter()
    for i in range(args.images):
        out = client.images.generate(model="bench-pipeline", prompt=args.prompt, size=args.size,
                                     extra_body={"seed": i, "steps": args.steps})
        assert out.data and out.data[0].b64_json
    return (time.perf_counter() - t0) / args.images


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pipeline", default=None, help="a diffusers pipeline directory (default: the tests' tiny one)")
    p.add_argument("--size", default="64x64")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--images", type=int, default=8, help="images per round and path")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads on both paths")
    p.add_argument("--prompt", default="a lighthouse on a cliff at dusk")
    args = p.parse_args()

    import openai
    import torch
    from diffusers import DiffusionPipeline

    from runlm.store import ModelStore
    from tests.runner.daemon import Daemon

    if args.pipeline:
        pipeline = Path(args.pipeline)
    else:
        from tests.fixtures.diffusion import tiny_pipeline

        pipeline = tiny_pipeline()
    width, height = (int(x) for x in args.size.split("x"))
    torch.set_num_threads(args.threads)
    pipe = DiffusionPipeline.from_pretrained(str(pipeline))
    pipe.set_progress_bar_config(disable=True)

    with tempfile.TemporaryDirectory(prefix="image-bench-") as home:
        ModelStore(Path(home)).pull(str(pipeline), "bench-pipeline")
        daemon = Daemon(Path(home)).start()
        try:
            resp = daemon.http.post("/engines/diffusers/_configure", json={
                "model": "bench-pipeline", "runtime_flags": ["--threads", str(args.threads)], "keep_alive": "-1"})
            assert resp.status_code == 202, resp.text
            client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
            t0 = time.perf_counter()
            served_seconds(client, argparse.Namespace(**{**vars(args), "images": 1}))  # the load, and a warm-up
            load = time.perf_counter() - t0
            direct_seconds(pipe, argparse.Namespace(**{**vars(args), "images": 1}), width, height)  # warm-up
            direct, served = [], []
            for r in range(args.rounds):
                direct.append(direct_seconds(pipe, args, width, height))
                served.append(served_seconds(client, args))
                print(f"round {r + 1}: direct {direct[-1]:.4f} s/image, served {served[-1]:.4f} s/image",
                      file=sys.stderr)
        finally:
            daemon.stop()

    d, s = statistics.median(direct), statistics.median(served)
    result = {"pipeline": str(pipeline), "size": args.size, "steps": args.steps, "images_per_round": args.images,
              "rounds": args.rounds, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "direct_s_per_image": direct, "served_s_per_image": served,
              "median_direct": d, "median_served": s, "overhead": s / d - 1, "served_first_request_s": load}
    out = ROOT / "bench" / "results" / "image_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"| path | s/image (median of {args.rounds} rounds x {args.images}) |\n|---|---|")
    print(f"| diffusers, in process | {d:.4f} |\n| runlm serve -> diffusers backend (openai client) | {s:.4f} |")
    print(f"\noverhead of the serving path: {100 * (s / d - 1):+.1f}% ({args.size}, {args.steps} steps, "
          f"{args.threads} thread(s)); first request with the load: {load:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
