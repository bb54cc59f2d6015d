"""Embedding throughput: sentences/s for the same sentences through runlm's ``LLM.encode``, through
runlm's HTTP API (``runlm serve-engine`` in a child process, the official ``openai`` client) and
through sentence-transformers, on the same model files, in one run; in-process peers alternate
round by round. Also checks that the vectors agree (minimum cosine against sentence-transformers).

    .venv/bin/python bench/embed_bench.py [--model minilm] [--sentences 1000] [--rounds 2]

Writes bench/results/embed_bench.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_WORDS = ("the a model server token batch engine local private fast vector search query document cat river "
          "mountain quantum coffee train music history garden ocean language city night winter").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """Lengths like real search traffic: mostly 5-30 words, a few long paragraphs."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.randint(5, 30) if i % 20 else rng.randint(80, 300)
        out.append(" ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + ".")
    return out


def run_runlm(llm, texts: list[str]):
    t0 = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs.data for o in outs]


def run_st(model, texts: list[str], batch_size: int):
    t0 = time.perf_counter()
    vecs = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
    return time.perf_counter() - t0, vecs


def start_server(model: str, batched_tokens: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "runlm.cli", "serve-engine", model, "--port", "0",
                             "--max-num-batched-tokens", str(batched_tokens), "--log-level", "warning"],
                            env=env, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        m = re.search(r" on (http://\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep draining
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError("the server did not start:\n" + "".join(seen))


def run_api(base_url: str, model: str, texts: list[str], batch: int, concurrency: int):
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    for _ in range(100):  # wait for the model to load
        try:
            client.embeddings.create(model=model, input="warm up")
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            time.sleep(0.2)
    chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda c: client.embeddings.create(model=model, input=c), chunks))
    elapsed = time.perf_counter() - t0
    import torch

    return elapsed, [torch.tensor(d.embedding) for r in results for d in r.data]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batched-tokens", type=int, default=2048, help="runlm's token budget per engine step")
    ap.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch (its default)")
    ap.add_argument("--api-batch", type=int, default=32, help="inputs per /v1/embeddings request")
    ap.add_argument("--api-concurrency", type=int, default=4)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from sentence_transformers import SentenceTransformer

    from runlm.catalog import resolve_model
    from runlm.engine.llm import LLM

    torch.set_num_threads(args.threads)
    texts = sentences(args.sentences)
    path = resolve_model(args.model)
    llm = LLM(args.model, max_num_batched_tokens=args.batched_tokens)
    st = SentenceTransformer(str(path), device="cpu")
    run_runlm(llm, texts[:64])
    run_st(st, texts[:64], args.st_batch_size)  # warm-up both
    times: dict[str, list[float]] = {"runlm LLM.encode": [], "sentence-transformers": []}
    for _ in range(args.rounds):
        t, ours = run_runlm(llm, texts)
        times["runlm LLM.encode"].append(t)
        t, ref = run_st(st, texts, args.st_batch_size)
        times["sentence-transformers"].append(t)
    ours_t = torch.stack(ours)
    agreement = {"LLM.encode": F.cosine_similarity(ours_t, ref.float()).min().item()}
    del llm  # free the in-process engine before the server's

    proc, url = start_server(args.model, args.batched_tokens)
    try:
        times["runlm /v1/embeddings"] = []
        for _ in range(args.rounds):
            t, api_vecs = run_api(url, args.model, texts, args.api_batch, args.api_concurrency)
            times["runlm /v1/embeddings"].append(t)
        agreement["/v1/embeddings"] = F.cosine_similarity(torch.stack(api_vecs), ref.float()).min().item()
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    rate = {k: args.sentences / min(v) for k, v in times.items()}
    peer = rate["sentence-transformers"]
    print(f"\n{args.sentences} sentences, model {args.model}, {args.threads} threads, best of {args.rounds}\n")
    print("| path | sentences/s | vs sentence-transformers |\n|---|---:|---:|")
    for k, r in rate.items():
        print(f"| {k} | {r:.0f} | {r / peer:.2f}x |")
    print(f"\nminimum cosine vs sentence-transformers: {agreement}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "embed_bench.json").write_text(json.dumps({"args": vars(args), "seconds": times, "sentences_per_s": rate,
                                                      "min_cosine": agreement}, indent=2))


if __name__ == "__main__":
    main()
