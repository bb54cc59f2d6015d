"""runlm quantize against llama.cpp's own quantizer (llama_model_quantize, llama-cpp-python) on the same source:
wall time of each, side by side and alternating, and whether the files are the same bytes (then their KL from the
source is the same too).

    .venv/bin/python bench/quantize_bench.py --shapes qwen2.5-0.5b-shape --types q4_k_m,q8_0 --rounds 3

Each run is a child process from start to end (imports, reading, writing: what a user waits for); the source is
read once before the rounds so that the page cache serves both alike. The machine's load is whatever else runs
on it: compare the ratio, and state the CPU.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.quant_bench import FTYPES  # noqa: E402

FTYPES = {**FTYPES, "q5_k_m": 17, "q6_k": 18}


def source(shape: str) -> Path:
    from bench.models import CACHE, build_gguf

    f32 = CACHE / f"{shape}.f32.gguf"
    return f32 if f32.exists() else build_gguf(shape)


def run_llama(src: Path, out: Path, kind: str, threads: int) -> float:
    code = ("import sys, llama_cpp\np = llama_cpp.llama_model_quantize_default_params()\n"
            f"p.ftype = {FTYPES[kind]}\np.nthread = {threads}\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n")
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", code, str(src), str(out)], check=True, capture_output=True)
    return time.monotonic() - t


def run_runlm(src: Path, out: Path, kind: str, threads: int) -> float:
    t = time.monotonic()
    subprocess.run([sys.executable, "-m", "runlm.cli", "quantize", str(src), str(out), kind, "--threads", str(threads)],
                   check=True, capture_output=True)
    return time.monotonic() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen2.5-0.5b-shape", help="bench/models.py shapes, comma-separated")
    ap.add_argument("--types", default="q4_k_m,q8_0", help=f"of {', '.join(FTYPES)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    print(f"{args.threads} threads; ratios are runlm / llama.cpp (best of {args.rounds} each)", flush=True)
    for shape in args.shapes.split(","):
        src = source(shape)
        with open(src, "rb") as f:  # into the page cache before the rounds
            while f.read(1 << 24):
                pass
        for kind in args.types.split(","):
            with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
                ours, theirs = Path(tmp) / "runlm.gguf", Path(tmp) / "llama.gguf"
                times: dict[str, list[float]] = {"runlm": [], "llama.cpp": []}
                for _ in range(args.rounds):
                    times["llama.cpp"].append(run_llama(src, theirs, kind, args.threads))
                    times["runlm"].append(run_runlm(src, ours, kind, args.threads))
                same = filecmp.cmp(ours, theirs, shallow=False)
                best = {k: min(v) for k, v in times.items()}
                print(f"{shape} {kind}: runlm {best['runlm']:.2f}s, llama.cpp {best['llama.cpp']:.2f}s "
                      f"({best['runlm'] / best['llama.cpp']:.2f}x); same bytes: {same}; all: {times}", flush=True)


if __name__ == "__main__":
    main()
