"""``runlm bench MODEL``: a serving benchmark against the daemon (or any OpenAI-compatible ``--url``), as Model
Runner's ``docker model bench`` and ``vllm bench serve`` do: streamed completions at each concurrency level
and output length, a progress bar, a table of TTFT / TPOT / ITL percentiles and tokens/s, ``--json``, and a
PNG with ``--plot FILE``."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

TOPICS = ["a lighthouse keeper", "the history of bread", "how tides work", "a robot learning to paint",
          "the water cycle", "a city under the sea", "why leaves change colour", "a chess tournament"]
PERCENTILES = (50, 90, 99)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure a model's serving speed (TTFT, TPOT, ITL, tokens/s)",
                       description="Send streamed completions to MODEL at each concurrency level and output length "
                                   "and report time to first token, time per output token, inter-token latency "
                                   "percentiles and output tokens/s. Runs against the daemon unless --url is given.")
    p.add_argument("model", help="a model name the server knows (see runlm ls)")
    p.add_argument("--url", default=None, help="an OpenAI-compatible server instead of the daemon, e.g. "
                                               "http://127.0.0.1:8000 (API key: $RUNLM_API_KEY)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], metavar="N",
                   help="concurrent requests, one level each (default: 1 4)")
    p.add_argument("--output-len", type=int, nargs="+", default=[64], metavar="TOKENS",
                   help="output tokens per request, one run each (default: 64; end-of-sequence is ignored)")
    p.add_argument("--requests", type=int, default=None, metavar="N",
                   help="requests per level (default: 2 x concurrency, at least 4)")
    p.add_argument("--prompt", default=None, help="the prompt (default: short essay prompts, one per request)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE", help="write a PNG of tok/s and latency per level")
    p.set_defaults(func=cmd_bench)


def _prompts(n: int, prompt: str | None) -> list[str]:
    return [prompt or f"Write a detailed essay about {TOPICS[i % len(TOPICS)]}. Essay {i}:" for i in range(n)]


async def _run(url: str, args: argparse.Namespace, headers: dict[str, str]) -> tuple[list[dict[str, Any]], float]:
    import httpx
    from tqdm import tqdm

    from runlm.benchmark.load import one_request, run_level, summarise
    from runlm.cli.client import CLIError

    plan = [(c, n, args.requests or max(4, 2 * c)) for n in args.output_len for c in args.concurrency]
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800, connect=10), limits=limits,
                                 headers=headers) as http:
        t0 = time.perf_counter()  # the first request loads the model: not counted in any level
        warm = await one_request(http, {"model": args.model, "prompt": "Hello", "max_tokens": 1})
        if not warm.ok:
            raise CLIError(f"the warm-up request failed: {warm.error}")
        load_s = time.perf_counter() - t0
        rows = []
        with tqdm(total=sum(r for _, _, r in plan), unit="req", file=sys.stderr, disable=None) as bar:
            for c, n, count in plan:
                bar.set_description(f"c={c} out={n}")
                bodies = [{"model": args.model, "prompt": p, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
                          for p in _prompts(count, args.prompt)]
                results, duration = await run_level(http, bodies, c, on_done=lambda _: bar.update())
                rows.append({"concurrency": c, "output_len": n, "requests": count,
                             **summarise(results, duration, percentiles=PERCENTILES)})
    return rows, load_s


def _table(rows: list[dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    head = ["CONC", "OUT", "OK", "TOK/S", "REQ/S"]
    for name in ("TTFT", "TPOT", "ITL"):
        head += [f"{name} P{q}" for q in PERCENTILES]
    table = []
    for r in rows:
        cells = [str(r["concurrency"]), str(r["output_len"]), f"{r['completed']}/{r['requests']}",
                 f"{r['output_tok_s']:.1f}", f"{r['req_s']:.2f}"]
        for name in ("ttft", "tpot", "itl"):
            cells += [f"{r[f'{name}_p{q}_ms']:.0f}ms" for q in PERCENTILES]
        table.append(cells)
    return table, head


def _plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tps, lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in sorted({r["output_len"] for r in rows}):
        mine = [r for r in rows if r["output_len"] == n]
        xs = [r["concurrency"] for r in mine]
        tps.plot(xs, [r["output_tok_s"] for r in mine], marker="o", label=f"{n} output tokens")
        lat.plot(xs, [r["ttft_p50_ms"] for r in mine], marker="o", label=f"TTFT p50, {n} out")
        lat.plot(xs, [r["tpot_p50_ms"] for r in mine], marker="s", linestyle="--", label=f"TPOT p50, {n} out")
    tps.set(xlabel="concurrent requests", ylabel="output tokens/s", title="throughput")
    lat.set(xlabel="concurrent requests", ylabel="ms", title="latency", yscale="log")
    for ax in (tps, lat):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_bench(args: argparse.Namespace) -> int:
    from runlm.cli.client import CLIError, connect, print_json, print_table

    if min(args.concurrency) < 1 or min(args.output_len) < 1 or (args.requests is not None and args.requests < 1):
        raise CLIError("--concurrency, --output-len and --requests must be at least 1", code=2)
    url = args.url.rstrip("/") if args.url else connect(required=True).url
    key = os.environ.get("RUNLM_API_KEY")
    rows, load_s = asyncio.run(_run(url, args, {"Authorization": f"Bearer {key}"} if key else {}))
    if args.plot:
        try:
            _plot(rows, args.plot, f"runlm bench {args.model}")
        except ImportError:
            raise CLIError("--plot needs matplotlib: pip install matplotlib") from None
    if args.json:
        print_json({"model": args.model, "url": url, "warmup_s": load_s, "results": rows})
    else:
        print(f"{args.model} at {url} (warm-up, including any load: {load_s:.1f} s)")
        print_table(*_table(rows))
        for r in rows:
            if r["errors"]:
                print(f"errors at concurrency {r['concurrency']}: {'; '.join(r['errors'])}", file=sys.stderr)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 1 if any(r["failed"] for r in rows) else 0



