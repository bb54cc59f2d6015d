"""Per-token cost of constrained decoding: decode steps with and without grammars, and mixed batches.

For each batch size B it runs B requests that decode the same number of tokens, three ways:
all unconstrained, all constrained by a JSON schema, and half and half. It reports the decode
step time (median over steps once every sequence is decoding) and, measured directly, the time
spent in the grammar work itself (mask computation + applying it + advancing the matchers),
per step and per constrained token. With ``--backends`` it also compares llguidance and xgrammar
(if importable) on compile time and mask time for one schema over SmolLM2's vocabulary.

    .venv/bin/python bench/structured_bench.py [--model smollm2] [--tokens 48] [--batch 1 8]

Writes bench/results/structured_bench.json. The machine is shared: compare within one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

# A schema with room to write: a title and a list of chapters (free strings).
STORY = {"type": "object", "properties": {"title": {"type": "string"},
                                          "chapters": {"type": "array", "items": {"type": "string"}}},
         "required": ["title", "chapters"]}


class Timed:
    """Wraps a StructuredOutputManager method and adds up the seconds spent in it."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args):
        t = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.seconds += time.perf_counter() - t
            self.calls += 1


def run_batch(llm, prompt_ids: list[int], constrained: list[bool], tokens: int) -> dict:
    from runlm.engine.types.sampling_params import SamplingParams

    engine = llm.engine
    so = engine.structured
    mask, accept = Timed(so.mask_logits), Timed(so.accept)
    so.mask_logits, engine.runner.structured = mask, so  # instance attributes shadow the methods
    so.accept = accept
    for i, c in enumerate(constrained):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=not c,
                                structured_outputs={"json": STORY} if c else None)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt_ids}, params)
    steps, generated = [], [0] * len(constrained)
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        for out in outs:
            if out.finished:
                generated[int(out.request_id[1:])] = len(out.outputs[0].token_ids)
    del so.mask_logits, so.accept
    decode = steps[2:] or steps  # skip the prefill steps
    n_constrained = sum(constrained)
    constrained_tokens = sum(g for g, c in zip(generated, constrained) if c)
    grammar = mask.seconds + accept.seconds
    return {"batch": len(constrained), "constrained": n_constrained, "steps": len(steps),
            "tokens": sum(generated), "constrained_tokens": constrained_tokens,
            "step_ms_median": 1e3 * statistics.median(decode),
            "grammar_ms_per_step": 1e3 * grammar / max(len(steps), 1),
            "grammar_us_per_constrained_token": 1e6 * grammar / constrained_tokens if constrained_tokens else 0.0}


def compare_backends(tokenizer) -> dict:
    import llguidance
    import llguidance.torch as lgt

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}}},
              "required": ["name", "age", "tags"]}
    text = json.dumps({"name": "Alice Smith", "age": 42, "tags": ["a", "ccc"]}, separators=(",", ":"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    vocab = tokenizer.vocab_size
    out = {}
    t = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab, eos_token=sorted(tokenizer.stop_token_ids))
    tok_s = time.perf_counter() - t
    t = time.perf_counter()
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}))
    compile_s = time.perf_counter() - t
    bm = lgt.allocate_token_bitmask(1, vocab)
    times = []
    for i in ids:
        t = time.perf_counter()
        lgt.fill_next_token_bitmask(m, bm, 0)
        times.append(time.perf_counter() - t)
        m.consume_token(i)
    out["llguidance"] = {"tokenizer_ms": 1e3 * tok_s, "compile_ms": 1e3 * compile_s,
                         "mask_us_mean": 1e6 * statistics.mean(times)}
    try:
        import xgrammar as xgr
    except ImportError:
        out["xgrammar"] = "not installed"
        return out
    t = time.perf_counter()
    info = xgr.TokenizerInfo([tokenizer.hf.id_to_token(i) for i in range(vocab)], xgr.VocabType.BYTE_LEVEL,
                             vocab_size=vocab, stop_token_ids=sorted(tokenizer.stop_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    tok_s = time.perf_counter() - t
    t = time.perf_counter()
    grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t
    xm, xb, times = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, vocab), []
    for i in ids:
        t = time.perf_counter()
        xm.fill_next_token_bitmask(xb, 0)
        times.append(time.perf_counter() - t)
        xm.accept_token(i)
    out["xgrammar"] = {"tokenizer_ms": 1e3 * tok_s, "compile_ms": 1e3 * compile_s,
                       "mask_us_mean": 1e6 * statistics.mean(times)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", action="store_true", help="also compare llguidance and xgrammar")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from runlm.catalog import resolve_model
    from runlm.engine.llm import LLM

    llm = LLM(str(resolve_model(args.model)))
    ids = llm.encode_chat([{"role": "user", "content": "Tell me a long story as JSON."}])
    run_batch(llm, ids, [True], 4)  # warm-up, and builds the grammar tokenizer
    rows = []
    for b in args.batch:
        for label, mix in (("none", [False] * b), ("all", [True] * b), ("half", [i % 2 == 0 for i in range(b)])):
            if b == 1 and label == "half":
                continue
            llm.reset_prefix_cache()
            row = {"mode": label, **run_batch(llm, ids, mix, args.tokens)}
            rows.append(row)
            print(f"B={row['batch']:<3} constrained={row['constrained']:<3} tokens {row['tokens']:<4}"
                  f" step {row['step_ms_median']:7.1f} ms"
                  f"  grammar {row['grammar_ms_per_step']:6.2f} ms/step"
                  f"  {row['grammar_us_per_constrained_token']:7.0f} us/constrained token", flush=True)
    result = {"model": args.model, "tokens": args.tokens, "threads": args.threads, "rows": rows}
    if args.backends:
        result["backends"] = compare_backends(llm.get_tokenizer())
        print(json.dumps(result["backends"], indent=1))
    out = Path(__file__).parent / "results" / "structured_bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
