"""Streamed requests at a fixed concurrency against an OpenAI-compatible ``/v1/completions``, and their figures:
TTFT (time to first token), TPOT (time per output token after the first), ITL (gaps between streamed
chunks), end-to-end latency, and output tokens/s over the whole run."""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    error: str = ""


async def one_request(http: httpx.AsyncClient, body: dict[str, Any]) -> RequestResult:
    """One streamed completion (``body`` without ``stream``); usage is asked for, so tokens are counted exactly."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = None
    res = RequestResult(ok=False)
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    res.error = str(chunk["error"])[:200]
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                res.text += chunk["choices"][0]["text"]
        res.e2e = time.perf_counter() - start
        res.ok = last is not None
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = repr(exc)
    return res


async def run_level(client: httpx.AsyncClient, bodies: list[dict[str, Any]], concurrency: int,
                    on_done: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Every body, at most ``concurrency`` at once; returns the results and the run's wall time."""
    sem = asyncio.Semaphore(concurrency)

    async def limited(body: dict[str, Any]) -> RequestResult:
        async with sem:
            res = await one_request(client, body)
        if on_done is not None:
            on_done(res)
        return res
    t0 = time.perf_counter()
    results = await asyncio.gather(*(limited(b) for b in bodies))
    return list(results), time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summarise(results: list[RequestResult], duration: float, count_tokens: Callable[[str], int] | None = None,
              percentiles: tuple[int, ...] = (50, 99)) -> dict[str, Any]:
    """The run's figures: ``{ttft,tpot,itl,e2e}_{mean,p50,...}_ms`` (``median`` is p50), tok/s, failures."""
    ok = [r for r in results if r.ok]
    for r in ok:
        if not r.output_tokens and count_tokens is not None:  # the server sent no usage: count the text
            r.output_tokens = count_tokens(r.text)
    series = {"ttft": [r.ttft for r in ok], "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
                                                      if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl], "e2e": [r.e2e for r in ok]}
    out_tokens = sum(r.output_tokens for r in ok)
    row: dict[str, Any] = {"completed": len(ok), "failed": len(results) - len(ok),
                           "errors": sorted({r.error for r in results if r.error})[:3], "duration_s": duration,
                           "output_tokens": out_tokens, "output_tok_s": out_tokens / duration if duration else 0.0,
                           "req_s": len(ok) / duration if duration else 0.0}
    for name, xs in series.items():
        row[f"{name}_mean_ms"] = 1000 * _mean(xs)
        row[f"{name}_median_ms"] = 1000 * pct(xs, 50)
        for q in percentiles:
            row[f"{name}_p{q}_ms"] = 1000 * pct(xs, q)
    return row
