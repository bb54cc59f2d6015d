"""Serving benchmark: runlm serve-engine vs llama.cpp's own batching server (``llama-server -np 32``,
built once by bench/llama_server.py) and llama-cpp-python's server, on the same GGUF, in one run.

Drives each server's HTTP API the way ``vllm bench serve`` does: streaming /v1/completions with
``stream_options.include_usage``, a fixed number of prompts at a fixed concurrency, and per
request TTFT (time to first token), TPOT (time per output token after the first), ITL (gaps
between streamed chunks) and end-to-end latency; output tokens/s over the whole run. Both servers
get the same prompts and the same output length (end-of-sequence tokens are banned through
logit_bias, which all accept), and the peers rotate at each concurrency level. llama-server gets
32 slots of the same context length and continuous batching; llama-cpp-python's server answers one
request at a time.

    .venv/bin/python bench/serve_bench.py [--model smollm2] [--concurrency 1 8 32] [--output-len 24]
        [--peers runlm llama-server llama-cpp-python]

Writes bench/results/serve_bench.json and bench/results/serve_bench.md; prints the table with
runlm / peer ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from runlm.benchmark import load  # noqa: E402  (the measuring code runlm bench shares)
from runlm.benchmark.load import RequestResult, summarise  # noqa: E402

TOPICS = ["a lighthouse keeper", "the history of bread", "how tides work", "a robot learning to paint",
          "the water cycle", "a city under the sea", "why leaves change colour", "a chess tournament",
          "the first trip to Mars", "a bakery at dawn", "volcanoes", "a lost dog finding home"]


def prompts(n: int) -> list[str]:
    return [f"Write a detailed essay about {TOPICS[i % len(TOPICS)]}. Essay {i}: In the beginning,"
            for i in range(n)]


@dataclass
class Server:
    name: str
    cmd: list[str]
    url: str
    env: dict
    proc: subprocess.Popen | None = None
    log: list[str] = field(default_factory=list)

    def start(self, timeout: float = 300) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{''.join(self.log)[-3000:]}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200 and \
                        httpx.post(f"{self.url}/v1/completions", timeout=120,
                                   json={"prompt": "Hello", "max_tokens": 2}).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become ready")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PEERS = ("runlm", "llama-server", "llama-cpp-python")
SLOTS = 32  # llama-server's parallel sequences (-np)


def server(name: str, model_path: str, threads: int, ctx: int) -> Server:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if name == "runlm":
        return Server(name, [sys.executable, "-m", "runlm.cli", "serve-engine", model_path, "--port", str(port),
                             "--served-model-name", "bench", "--max-model-len", str(ctx), "--threads", str(threads),
                             "--log-level", "warning"], url, env)
    if name == "llama-server":
        from bench.llama_server import llama_server

        return Server(name, [str(llama_server()), "-m", model_path, "--port", str(port), "--host", "127.0.0.1",
                             "-a", "bench", "-np", str(SLOTS), "-c", str(ctx * SLOTS), "-t", str(threads),
                             "-tb", str(threads), "--cont-batching", "--log-disable"], url, env)
    return Server(name, [sys.executable, "-m", "llama_cpp.server", "--model", model_path, "--port", str(port),
                         "--host", "127.0.0.1", "--model_alias", "bench", "--n_ctx", str(ctx),
                         "--n_threads", str(threads), "--n_threads_batch", str(threads),
                         "--interrupt_requests", "False"],  # else a new request cuts the running one
                  url, env)


async def run_level(url: str, texts: list[str], concurrency: int, output_len: int,
                    banned: dict[str, float]) -> tuple[list[RequestResult], float]:
    bodies = [{"model": "bench", "prompt": p, "max_tokens": output_len, "temperature": 0.0, "logit_bias": banned}
              for p in texts]
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as http:
        return await load.run_level(http, bodies, concurrency)


def table(rows: list[dict], levels: list[int], peers: list[str]) -> str:
    """One row per level and metric: each peer's figure, then runlm / each other peer."""
    cols = [("output_tok_s", "out tok/s", True), ("ttft_median_ms", "TTFT p50 ms", False),
            ("ttft_p99_ms", "TTFT p99 ms", False), ("tpot_median_ms", "TPOT p50 ms", False),
            ("itl_median_ms", "ITL p50 ms", False), ("itl_p99_ms", "ITL p99 ms", False)]
    others = [p for p in peers if p != "runlm"]
    head = ["concurrency", "prompts", "metric", *peers, *(f"runlm / {p}" for p in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in levels:
        at = {r["server"]: r for r in rows if r["concurrency"] == c}
        for key, label, higher_better in cols:
            ratios = [at["runlm"][key] / at[p][key] if at[p][key] else float("nan") for p in others]
            cells = [str(c), str(at["runlm"]["prompts"]), label + ("" if higher_better else " (lower is better)"),
                     *(f"{at[p][key]:.1f}" for p in peers), *(f"{x:.2f}" for x in ratios)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts", type=int, nargs="+", default=None,
                    help="prompts per level (default: 2 x concurrency, at least 3)")
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    args = ap.parse_args()
    if "runlm" not in args.peers:
        ap.error("--peers must include runlm (the ratios are runlm / peer)")
    sys.path.insert(0, str(ROOT))
    from runlm.catalog import resolve_model

    model_path = str(resolve_model(args.model))
    counts = args.prompts or [max(3, min(2 * c, 32)) for c in args.concurrency]
    names = ["runlm", *(p for p in args.peers if p != "runlm")]
    peers = [server(name, model_path, args.threads, args.ctx) for name in names]
    rows: list[dict] = []
    try:
        for s in peers:
            print(f"starting {s.name} ...", flush=True)
            s.start()
        tok = httpx.post(f"{peers[0].url}/v1/tokenize", json={"prompt": "<|im_end|><|endoftext|>",
                                                              "add_special_tokens": False}).json()["tokens"]
        banned = {str(t): -100.0 for t in tok}  # no early end-of-sequence: equal output lengths on both

        def count_tokens(text: str) -> int:
            return httpx.post(f"{peers[0].url}/v1/tokenize", json={"prompt": text, "add_special_tokens": False}
                              ).json()["count"]
        for i, (c, n) in enumerate(zip(args.concurrency, counts)):
            order = peers[i % len(peers):] + peers[:i % len(peers)]  # rotate who goes first
            for s in order:
                results, duration = asyncio.run(run_level(s.url, prompts(n), c, args.output_len, banned))
                row = {"server": s.name, "concurrency": c, "prompts": n, "output_len": args.output_len,
                       **summarise(results, duration, count_tokens)}
                rows.append(row)
                print(f"{s.name:>9} c={c:<3} n={n:<3} {row['output_tok_s']:7.1f} out tok/s  "
                      f"TTFT p50 {row['ttft_median_ms']:8.0f} ms  TPOT p50 {row['tpot_median_ms']:7.0f} ms  "
                      f"failed {row['failed']} {' '.join(row['errors'])}", flush=True)
    finally:
        for s in peers:
            s.stop()
    md = table(rows, args.concurrency, names)
    print("\n" + md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "threads": args.threads, "output_len": args.output_len,
            "cpu": _cpu_name(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    (out / "serve_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (out / "serve_bench.md").write_text(f"# Serving benchmark ({meta['model']}, {meta['threads']} threads, "
                                        f"{meta['output_len']} output tokens, {meta['time']})\n\n{md}\n")
    return 1 if any(r["failed"] for r in rows) else 0


def _cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"model name\s*:\s*(.*)", text)
        return m.group(1).strip() if m else "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
