"""Single-stream decode speed: runlm (the `runlm run` path) vs llama-cpp-python, same GGUF file.

Each measurement runs in its own child process (so thread pools and OpenMP settings of one
peer never touch the other); peers alternate round by round. Prints a table of tokens/s and
the runlm / llama.cpp ratio, and writes JSON to bench/results/decode_speed.json.

    .venv/bin/python bench/decode_speed.py [--model smollm2] [--tokens 128] [--rounds 3]
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

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def measure_runlm(model: str, tokens: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from runlm.catalog import resolve_model
    from runlm.engine.core.detokenizer import DELTA
    from runlm.engine.llm import LLM
    from runlm.engine.types.sampling_params import SamplingParams

    llm = LLM(str(resolve_model(model)), max_num_seqs=1)  # what `runlm run` builds
    ids = llm.encode_chat([{"role": "user", "content": PROMPT}])
    llm.generate([{"prompt_token_ids": ids[:8]}], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.reset_prefix_cache()
    engine = llm.engine
    engine.add_request("bench", {"prompt_token_ids": ids},
                       SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), output_kind=DELTA)
    t0 = time.perf_counter()
    times = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            times += [time.perf_counter()] * len(out.outputs[0].token_ids)
    return _result(len(ids), t0, times)


def measure_llamacpp(model: str, tokens: int, threads: int) -> dict:
    from llama_cpp import Llama

    from runlm.catalog import resolve_model
    from runlm.formats.chat_template import render_chat

    path = resolve_model(model)
    llm = Llama(str(path), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    template = llm.metadata.get("tokenizer.chat_template")
    ids = llm.tokenize(render_chat([{"role": "user", "content": PROMPT}], template).encode(), special=True)
    llm.eval(ids[:8])  # warm-up
    llm.reset()
    t0 = time.perf_counter()
    times = []
    for n, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
        times.append(time.perf_counter())
        if n + 1 >= tokens:
            break
    return _result(len(ids), t0, times)


def _result(prompt_tokens: int, t0: float, times: list[float]) -> dict:
    decode_s = times[-1] - times[0]
    return {"prompt_tokens": prompt_tokens, "generated": len(times), "ttft_s": times[0] - t0,
            "decode_tok_s": (len(times) - 1) / decode_s if decode_s > 0 else float("nan")}


def _child(peer: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, __file__, "--child", peer, "--model", args.model, "--tokens", str(args.tokens),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--child", choices=["runlm", "llamacpp"])
    args = ap.parse_args()
    if args.child:
        fn = measure_runlm if args.child == "runlm" else measure_llamacpp
        print(json.dumps(fn(args.model, args.tokens, args.threads)))
        return
    runs: dict[str, list[dict]] = {"runlm": [], "llamacpp": []}
    for r in range(args.rounds):
        for peer in runs:
            res = _child(peer, args)
            runs[peer].append(res)
            print(f"round {r + 1} {peer:9s} decode {res['decode_tok_s']:6.1f} tok/s  "
                  f"ttft {res['ttft_s'] * 1000:6.0f} ms", flush=True)
    summary = {peer: {"decode_tok_s": statistics.median(x["decode_tok_s"] for x in v),
                      "ttft_s": statistics.median(x["ttft_s"] for x in v)} for peer, v in runs.items()}
    ratio = summary["runlm"]["decode_tok_s"] / summary["llamacpp"]["decode_tok_s"]
    print(f"\n| model | runlm tok/s | llama.cpp tok/s | ratio |\n|---|---|---|---|\n"
          f"| {args.model} | {summary['runlm']['decode_tok_s']:.1f} | {summary['llamacpp']['decode_tok_s']:.1f} "
          f"| {ratio:.2f}x |")
    out = Path(__file__).parent / "results" / "decode_speed.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "tokens": args.tokens, "threads": args.threads,
                               "runs": runs, "summary": summary, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
