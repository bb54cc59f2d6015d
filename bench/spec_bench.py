"""Speculative decoding: decode speed with and without speculation (n-gram prompt lookup, or a draft model
with --draft), on prompts whose answers repeat their input (rewrite this code, quote this passage),
single-stream and several streams at once.

Greedy, so both runs produce the same tokens (checked); each configuration gets its own engine, and
runs alternate round by round on this noisy shared machine. Prints a table (acceptance rate, mean
accepted length, tokens/s, speedup) and writes JSON to bench/results/spec_bench.json.

    .venv/bin/python bench/spec_bench.py [--model smollm2] [--tokens 96] [--streams 1 8] [--rounds 2]
                                         [--draft MODEL] [--k 5] [--threads N] [--cpu-time] [--smollm2-pair]
                                         [--prompt copy|story] [--exclude-prefill]

``--exclude-prefill``: time decoding alone (each prompt is put in the prefix cache by an untimed run first);
by default the time includes the prompt's prefill, the same in both engines.

``--prompt story``: ordinary text (write a short story), where the output rarely repeats the prompt and
speculation must cost next to nothing; the default ``copy`` prompts repeat their input.

``--smollm2-pair``: a real close pair, smollm2 requantized by llama.cpp to Q8_0 as the target and to Q4_0 as
the draft (from the shipped Q4_1 file; built once under .cache/bench-models).

On a machine shared with other work, ``--threads 1 --cpu-time`` measures the process's CPU time rather than
wall-clock: the work each configuration does, which other processes' load barely moves (with 2 threads, a
preempted thread stalls every parallel region, and wall-clock figures swing many times over).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

CODE = '''def parse_config(path):
    """Read key = value lines, skipping comments and blank lines."""
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            config[key.strip()] = value.strip()
    return config
'''
PASSAGE = ("The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
           "the ninety steps, trimmed the wick and wound the clockwork that turned the great lens. Ships "
           "passing in the dark counted its flashes, three short and one long, and knew where they were.")
STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PROMPTS = [f"Rewrite this code with the variable `config` renamed to `settings`. Keep everything else the same.\n\n"
           f"{CODE}",
           f"Quote the following passage word for word, then stop.\n\n{PASSAGE}"]


def run(llm, prompts: list[list[int]], tokens: int, clock=time.perf_counter,  # type: ignore[no-untyped-def]
        exclude_prefill: bool = False):
    from runlm.engine.types.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    if exclude_prefill:  # the prompts' blocks into the prefix cache first: the timed run decodes (and recomputes
        # at most a block's worth of each prompt)
        llm.generate([{"prompt_token_ids": p} for p in prompts], replace(params, max_tokens=1), use_tqdm=False)
    t0 = clock()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = clock() - t0
    return [o.outputs[0].token_ids for o in outs], sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def smollm2_as(key: str) -> Path:
    """smollm2's shipped Q4_1 file requantized by llama.cpp to ``key`` (q8_0, q4_0), built once."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.models import CACHE
    from bench.quant_bench import quantize
    from runlm.catalog import resolve_model

    target = CACHE / f"smollm2-135m.{key}.gguf"
    if not target.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        quantize(Path(resolve_model("smollm2")), target, key, requantize=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--draft", default=None, help="a draft model (default: n-gram lookup)")
    ap.add_argument("--threads", type=int, default=None, help="the engines' threads (default: all cores)")
    ap.add_argument("--cpu-time", action="store_true", help="tokens per CPU second of this process, not wall-clock")
    ap.add_argument("--prompt", choices=("copy", "story"), default="copy",
                    help="copy: rewrite code / quote a passage; story: ordinary text")
    ap.add_argument("--exclude-prefill", action="store_true", help="time decoding alone, the prompts prefix-cached")
    ap.add_argument("--smollm2-pair", action="store_true", help="target smollm2 Q8_0, draft smollm2 Q4_0")
    args = ap.parse_args()
    if args.smollm2_pair:
        args.model, args.draft = (str(smollm2_as(key)) for key in ("q8_0", "q4_0"))
    clock = time.process_time if args.cpu_time else time.perf_counter

    from runlm.catalog import resolve_model
    from runlm.engine.llm import LLM

    path = str(resolve_model(args.model))
    plain = LLM(path, max_num_seqs=max(args.streams), threads=args.threads)
    method = "draft_model" if args.draft else "ngram"
    config = {"method": method, "num_speculative_tokens": args.k}
    if args.draft:
        config["model"] = str(resolve_model(args.draft))
    spec = LLM(path, max_num_seqs=max(args.streams), threads=args.threads, speculative_config=config)
    texts = PROMPTS if args.prompt == "copy" else [STORY]
    encoded = [plain.encode_chat([{"role": "user", "content": p}]) for p in texts]
    rows = []
    for streams in args.streams:
        prompts = [encoded[i % len(encoded)] for i in range(streams)]
        run(plain, prompts[:1], 4), run(spec, prompts[:1], 4)  # warm-up
        speeds: dict[str, list[float]] = {"plain": [], "spec": []}
        stats = spec.engine.spec.stats
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        for _ in range(args.rounds):
            want, s_plain = run(plain, prompts, args.tokens, clock, args.exclude_prefill)
            got, s_spec = run(spec, prompts, args.tokens, clock, args.exclude_prefill)
            assert got == want, "speculation changed the greedy output"
            speeds["plain"].append(s_plain)
            speeds["spec"].append(s_spec)
        drafts, drafted, accepted = (now - then for now, then in zip(
            (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
        p, s = statistics.median(speeds["plain"]), statistics.median(speeds["spec"])
        rows.append({"model": args.model, "method": args.draft or "ngram", "k": args.k, "streams": streams,
                     "prompt": args.prompt, "native": bool(spec.engine.native),
                     "prefill_timed": not args.exclude_prefill,
                     "acceptance_rate": accepted / drafted if drafted else 0.0,
                     "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
                     "plain_tok_s": p, "spec_tok_s": s, "speedup": s / p,
                     "clock": "cpu" if args.cpu_time else "wall", "threads": args.threads})
    print("| model | prompt | method | streams | acceptance | mean accepted length | plain tok/s | spec tok/s "
          "| speedup |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['prompt']} | {r['method']} k={r['k']} | {r['streams']} | "
              f"{r['acceptance_rate']:.2f} | {r['mean_accepted_length']:.2f} | {r['plain_tok_s']:.1f} | "
              f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x |")
    out = Path(__file__).parent / "results" / f"spec_bench_{method}_{args.prompt}_{Path(path).stem}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
