"""A bf16 safetensors directory on the native runner against the torch runner: decode speed and peak RSS.

The 0.5B-shape model of bench/models.py (random weights, tied embeddings, q/k/v biases) saved with every
tensor in bfloat16 (fp16 with ``--dtype float16``), as checkpoints ship. Both runners compute on the matrices
as stored (ggml's BF16 dot products; the torch runner's fast path keeps them as views too) with fp32
activations, so the difference is what runs around the kernels: one native call per step against torch's
per-layer loop, and ~220 MiB of torch. Children alternate round by round (bench/quant_bench.py's child);
peak RSS is each child's VmHWM, beside the weights file's size.

Writes bench/results/safetensors_bench.json and .md.

    .venv/bin/python bench/safetensors_bench.py [--rounds 2] [--gen-tokens 64] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.models import CACHE, build_safetensors  # noqa: E402
from bench.quant_bench import RESULTS, cpu_name  # noqa: E402

PEERS = ("native", "torch")
MODEL = "qwen2.5-0.5b-shape"


def half_dir(dtype: str) -> Path:
    """The 0.5B-shape model with every tensor cast to ``dtype`` (built once, beside the fp32 one)."""
    target = CACHE / f"{MODEL}-{dtype}"
    if (target / "model.safetensors").exists():
        return target
    from tests.fixtures.half_models import cast_dir

    return cast_dir(build_safetensors(MODEL), target, dtype)


def prompt_ids(path: Path, n: int) -> list[int]:
    from runlm.formats.tokenizer import Tokenizer
    from runlm.models.evaluate import english_text

    return Tokenizer.from_dir(path).encode(english_text())[:n]


def run_child(peer: str, path: Path, ids: list[int], args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false",
               RUNLM_NATIVE_RUNNER="1" if peer == "native" else "0")
    cmd = [sys.executable, str(ROOT / "bench" / "quant_bench.py"), "--child", "runlm-fast", "--model", str(path),
           "--ids", json.dumps(ids), "--gen-tokens", str(args.gen_tokens), "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{peer} on {path.name} failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["runner"] != peer:
        raise RuntimeError(f"the {peer} child ran the {result['runner']} runner")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    args = ap.parse_args()
    path = half_dir(args.dtype)
    ids = prompt_ids(path, args.prompt_tokens)
    runs: dict[str, list[dict]] = {p: [] for p in PEERS}
    for r in range(args.rounds):
        for peer in (PEERS if r % 2 == 0 else PEERS[::-1]):
            runs[peer].append(run_child(peer, path, ids, args))
            print(f"round {r + 1} {peer}: {runs[peer][-1]['decode_tok_s']:.1f} tok/s, "
                  f"peak RSS {runs[peer][-1]['peak_rss'] / 1e6:.0f} MB", flush=True)
    median = {p: {k: statistics.median(x[k] for x in runs[p])
                  for k in ("decode_tok_s", "prefill_tok_s", "ttft_s", "load_s", "peak_rss")} for p in PEERS}
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    a, b = median["native"], median["torch"]
    lines = [f"{MODEL} ({args.dtype} safetensors, {size / 1e6:.0f} MB of weights), {args.prompt_tokens}-token prompt, "
             f"{args.gen_tokens} greedy tokens, {args.threads} threads, median of {args.rounds} rounds; {cpu_name()}",
             "", "| runner | decode tok/s | prefill tok/s | TTFT ms | load s | peak RSS MB | RSS / weights |",
             "|---|---|---|---|---|---|---|"]
    for peer in PEERS:
        m = median[peer]
        lines.append(f"| {peer} | {m['decode_tok_s']:.1f} | {m['prefill_tok_s']:.0f} | {1e3 * m['ttft_s']:.0f} | "
                     f"{m['load_s']:.2f} | {m['peak_rss'] / 1e6:.0f} | {m['peak_rss'] / size:.2f}x |")
    lines += ["", f"native / torch: decode {a['decode_tok_s'] / b['decode_tok_s']:.2f}x, prefill "
              f"{a['prefill_tok_s'] / b['prefill_tok_s']:.2f}x, peak RSS {a['peak_rss'] / b['peak_rss']:.2f}x"]
    report = "\n".join(lines)
    print(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "safetensors_bench.json").write_text(json.dumps({"runs": runs, "median": median, "bytes": size,
                                                                "args": vars(args)}, indent=2))
    (RESULTS / "safetensors_bench.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
