"""What serving LoRA adapters costs: aggregate output tokens/s for 32 requests with 0, 1 and 4 distinct
rank-16 adapters (every module q/k/v/o/gate/up/down adapted), on the 0.5B-shape model by default.

Each configuration runs the same 32 prompts (the adapters assigned round-robin) through one engine
with ``max_loras`` = 4, alternating configurations over ``--rounds`` to spread the machine's noise;
it reports the median tokens/s per configuration and the ratio to the no-adapter run. The issue's
target: 4 adapters cost at most 25% of the no-adapter throughput (ratio >= 0.75).

    .venv/bin/python bench/lora_bench.py [--model qwen2.5-0.5b-shape | a model directory] [--tokens 32]

Writes bench/results/lora_bench.json. Adapters are random, made by peft (cached beside the model).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def adapters(model: Path, count: int, rank: int) -> list[Path]:
    from tests.fixtures.lora import write_peft_adapter

    return [write_peft_adapter(model, model.parent / f"{model.name}-lora-r{rank}-s{i}", rank=rank, seed=i,
                               alpha=2.0 * rank, scale=0.01) for i in range(count)]


def run(llm, prompts: list[list[int]], loras: list, tokens: int) -> float:
    from runlm.engine.types.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[loras[i % len(loras)] if loras else None for i in range(len(prompts))])
    seconds = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b-shape", help="a bench/models.py shape or a model directory")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora_bench.json"))
    args = ap.parse_args()

    import random

    from runlm.engine.llm import LLM
    from runlm.engine.types.config import physical_cores
    from runlm.engine.types.lora_request import LoRARequest

    if Path(args.model).is_dir():
        model = Path(args.model)
    else:
        from bench.models import build_safetensors

        model = build_safetensors(args.model)
    paths = adapters(model, 4, args.rank)
    llm = LLM(str(model), enable_lora=True, max_loras=4, max_lora_rank=args.rank, max_num_seqs=args.requests)
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(3, min(vocab, 49152)) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    configs = {n: [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths[:n])] for n in (0, 1, 4)}
    run(llm, prompts[:2], configs[4], 2)  # warm-up: loads every adapter, compiles the kernels
    results: dict[int, list[float]] = {n: [] for n in configs}
    for _ in range(args.rounds):
        for n, loras in configs.items():
            results[n].append(run(llm, prompts, loras, args.tokens))
    base = statistics.median(results[0])
    report = {"model": str(model.name), "requests": args.requests, "prompt_tokens": args.prompt_tokens,
              "output_tokens": args.tokens, "rank": args.rank, "threads": physical_cores(),
              "tok_per_s": {str(n): statistics.median(v) for n, v in results.items()},
              "ratio_to_no_adapter": {str(n): statistics.median(v) / base for n, v in results.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("adapters  tok/s    ratio")
    for n in configs:
        print(f"{n:8d}  {report['tok_per_s'][str(n)]:7.1f}  {report['ratio_to_no_adapter'][str(n)]:.3f}")


if __name__ == "__main__":
    main()
