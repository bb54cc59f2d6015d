"""Where a single-stream decode step's time goes: the matmul and attention kernels vs everything else.

Wraps the kernel entry points (ggml / fp32 / int8 linear, paged attention) with timers, decodes
``--steps`` tokens of one request through the engine, and prints the kernels' share of the
step. Everything outside them (torch glue ops, Python, scheduling, sampling) is the overhead
a lean step removes.

    .venv/bin/python bench/profile_step.py [--model smollm2] [--steps 128] [--exact-numerics]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--exact-numerics", action="store_true")
    ap.add_argument("--no-fused", action="store_true", help="fast mode without the fused small ops (torch's)")
    ap.add_argument("--streams", type=int, default=1, help="concurrent requests decoding together")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="profile prefills of N-token prompts (--steps of them) instead of decode steps")
    args = ap.parse_args()

    import sys

    import runlm.kernels as kernels_pkg
    import runlm.kernels.fused as fused
    import runlm.kernels.ggml as ggml
    import runlm.models.attention as attention_mod
    import runlm.models.linear as model_linear
    from runlm.catalog import resolve_model
    from runlm.engine.llm import LLM
    from runlm.engine.types.sampling_params import SamplingParams

    linear_mod = sys.modules["runlm.kernels.linear"]  # the package re-exports a function of that name
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed(label, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[label] += time.perf_counter() - t0
                calls[label] += 1
        return wrapper

    if ggml.available():  # the extension's own function: layers bind it directly (Linear.direct_call)
        ext = ggml.module()
        ext.linear = timed("linear (ggml blocks)", ext.linear)
    model_linear.linear = timed("linear (fp32)", linear_mod.linear)
    model_linear.linear_q8 = timed("linear (int8 blocks)", linear_mod.linear_q8)
    attention_mod.kernels.paged_attention = timed("paged attention", kernels_pkg.paged_attention)
    if args.no_fused:
        fused.available = lambda: False  # the loader then leaves the model on torch's small ops
    elif fused.available():  # the fused small ops: timed too, but they are not matmul or attention

        class TimedOps:
            pass

        ops = TimedOps()
        for op in ("rms_norm", "add_rms_norm", "silu_mul", "qkv_rope_store"):
            setattr(ops, op, timed(f"fused {op}", getattr(fused.ops(), op)))
        fused._kernel.module = ops

    llm = LLM(str(resolve_model(args.model)), max_num_seqs=args.streams, threads=args.threads,
              exact_numerics=args.exact_numerics)
    ids = llm.encode_chat([{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
    engine = llm.engine
    if engine.native:  # one native call runs every layer (matmuls, attention and the fused small ops alike)
        from runlm.native.decoder import Decoder

        Decoder.forward = timed("native step: all layers", Decoder.forward)  # type: ignore[method-assign]
        model = engine.loaded.model
        model.compute_logits = timed("native lm_head", model.compute_logits)
    engine.add_request("warm", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=8))
    while engine.has_unfinished_requests():
        engine.step()
    if args.prefill:
        steps, total = _prefills(engine, args.prefill, args.steps, spent, calls)
    else:
        steps, total = _decode_steps(engine, ids, args.steps, spent, calls, args.streams)
    kernel = sum(v for k, v in spent.items() if not k.startswith("fused"))
    fused_s = sum(v for k, v in spent.items() if k.startswith("fused"))
    rows = {k: {"ms_per_step": 1e3 * v / steps, "calls_per_step": calls[k] / steps} for k, v in spent.items()}
    report = {"model": args.model, "exact_numerics": args.exact_numerics, "native": engine.native, "steps": steps,
              "ms_per_step": 1e3 * total / steps, "kernel_share": kernel / total, "fused_ops_share": fused_s / total,
              "kernels": rows}
    what = f"prefill of {args.prefill} tokens" if args.prefill else "decode step"
    runner, rest = ("native runner, no torch", "") if engine.native else ("torch runner", ", torch ops")
    print(f"{args.model} ({'exact' if args.exact_numerics else 'fast'}, {runner}): {1e3 * total / steps:.2f} ms per "
          f"{what}: {100 * kernel / total:.0f}% in matmul + attention kernels, {100 * fused_s / total:.0f}% in fused "
          f"small ops, {100 * (1 - (kernel + fused_s) / total):.0f}% everything else (Python, scheduling, sampling"
          f"{rest})")
    for k, r in sorted(rows.items(), key=lambda kv: -kv[1]["ms_per_step"]):
        print(f"  {k:24s} {r['ms_per_step']:6.2f} ms  {r['calls_per_step']:5.0f} calls")
    print(json.dumps(report))


def _decode_steps(engine, ids, n, spent, calls, streams=1):
    from runlm.engine.core.detokenizer import DELTA
    from runlm.engine.types.sampling_params import SamplingParams

    for i in range(streams):  # distinct prompts: no stream shares another's prefix
        engine.add_request(f"p{i}", {"prompt_token_ids": [*ids, 100 + i]},
                           SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True), output_kind=DELTA)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()  # prefill steps are not decode steps
    spent.clear(), calls.clear()
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - t0


def _prefills(engine, length, n, spent, calls):
    """``n`` prompts of ``length`` random tokens, each prefilled alone (distinct: no prefix-cache hits)."""
    import random

    from runlm.engine.types.sampling_params import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(length)] for _ in range(n + 1)]
    total = 0.0
    for i, prompt in enumerate(prompts):
        if i == 1:
            spent.clear(), calls.clear()
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if i:
            total += time.perf_counter() - t0
    return n, total


if __name__ == "__main__":
    main()
