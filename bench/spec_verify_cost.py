"""What verifying a draft costs: one sequence's forward pass over 1 + k rows (its last token and k draft
tokens) against a plain decode step's 1 row, phase by phase (prepare, forward, logits, verify or sample).

The rows go through the same path as a decode step (the fused layer loop, one quantized matmul per
projection for all rows, which reads each weight block once), so what each extra row adds is the
arithmetic: on an AVX2 CPU without VNNI the block kernels do about 55 G multiply-adds a second a core, and a
row of a 0.5B model is 0.5 G of them, while the step's weights stream from memory once. By default it
reports CPU time on one thread (the work, steady on a shared machine); ``--wall`` times wall-clock
with the engine's threads. Rounds alternate the row counts; each phase's minimum is kept.

    .venv/bin/python bench/spec_verify_cost.py [--model smollm2] [--k 1 3 5] [--rounds 5] [--wall]
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a builtin name or a model file")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 3, 5], help="draft lengths to verify")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=4, help="steps per row count and round")
    ap.add_argument("--wall", action="store_true", help="wall-clock with the engine's threads, not 1-thread CPU time")
    ap.add_argument("--exact-numerics", action="store_true")
    args = ap.parse_args()

    import torch

    from runlm.catalog import resolve_model
    from runlm.engine.core.scheduler import SchedulerOutput
    from runlm.engine.llm import LLM
    from runlm.engine.sample.rejection import verify_draft
    from runlm.engine.types.sampling_params import SamplingParams

    clock = time.perf_counter if args.wall else time.process_time
    llm = LLM(str(resolve_model(args.model)), max_num_seqs=1, exact_numerics=args.exact_numerics,
              threads=None if args.wall else 1)
    engine = llm.engine
    ids = llm.encode_chat([{"role": "user", "content": "Write a long story about a lighthouse keeper. " * 4}])
    engine.add_request("r", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    for _ in range(4):  # the prompt, then a few decode steps
        engine.step()
    seq = engine.scheduler.running[0]
    engine.blocks.grow(seq.table, seq.num_tokens + max(args.k) + 1)
    runner, model = engine.runner, engine.loaded.model
    phases = ("prepare", "forward", "logits", "verify")
    best: dict[int, dict[str, float]] = {k: dict.fromkeys(phases, float("inf")) for k in [0, *args.k]}

    @torch.inference_mode()
    def step(k: int) -> list[float]:
        """One step's phases; the same positions are rewritten each time (nothing is committed)."""
        seq.spec.tokens = [seq.token_ids[-1]] * k  # what the tokens are does not change the cost
        sched = SchedulerOutput([seq], [1 + k])
        t0 = clock()
        batch = runner.prepare(sched)
        t1 = clock()
        hidden = runner.run_model(batch)
        t2 = clock()
        rows = [batch.spec_rows[0] + j for j in range(k + 1)] if k else batch.sample_rows
        raw = model.compute_logits(hidden[rows]).float().cpu()
        t3 = clock()
        if k:
            verify_draft(raw, seq, None)
        else:
            runner.sample(raw, [seq])
        t4 = clock()
        seq.spec.tokens = []
        return [t1 - t0, t2 - t1, t3 - t2, t4 - t3]

    for _ in range(args.rounds):
        for k in best:
            for _ in range(args.reps):
                for name, spent in zip(phases, step(k)):
                    best[k][name] = min(best[k][name], spent)
    base = sum(best[0].values())
    how = "wall-clock" if args.wall else "CPU time on 1 thread"
    print(f"{args.model}: context {seq.num_tokens} tokens, {how}, minimum per phase (ms)")
    print("| rows | prepare | forward | logits | verify/sample | total | x decode step |")
    print("|---|---|---|---|---|---|---|")
    report = []
    for k, b in best.items():
        total = sum(b.values())
        print(f"| {k + 1} | " + " | ".join(f"{1e3 * b[p]:.2f}" for p in phases) + f" | {1e3 * total:.2f} | "
              f"{total / base:.2f}x |")
        report.append({"rows": k + 1, **{p: 1e3 * b[p] for p in phases}, "total_ms": 1e3 * total,
                       "ratio": total / base})
    print(json.dumps({"model": args.model, "clock": how, "rows": report}))


if __name__ == "__main__":
    main()
