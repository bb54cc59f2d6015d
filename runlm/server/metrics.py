"""Prometheus metrics at ``/metrics``, with vLLM's names under a ``runlm:`` prefix.

Gauges (running/waiting requests, KV-cache usage) and prefix-cache counters are read from the
engine when scraped; token counters and latency histograms are observed as outputs stream out.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from runlm.engine.types.outputs import RequestOutput

if TYPE_CHECKING:
    from runlm.engine.async_inproc import AsyncLLM
    from runlm.engine.engine_core import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector:
    """Reads the engine's counters at scrape time (None while the model loads)."""

    def __init__(self, get_engine: Callable[[], AsyncLLM | None], model_name: str) -> None:
        self.get_engine, self.model_name = get_engine, model_name

    def collect(self) -> Iterator:
        engine = self.get_engine()
        if engine is None:
            return
        s = engine.stats()
        label = ["model_name"]
        for name, doc, value in (("runlm:num_requests_running", "Sequences running in the engine.", s.num_running),
                                 ("runlm:num_requests_waiting", "Sequences waiting for a slot.", s.num_waiting),
                                 ("runlm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                                  s.kv_cache_usage)):
            g = GaugeMetricFamily(name, doc, labels=label)
            g.add_metric([self.model_name], value)
            yield g
        counters = [("runlm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     s.prefix_cache_queries),
                    ("runlm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
                    ("runlm:num_preemptions", "Sequences preempted (recomputed later).", s.num_preemptions)]
        spec = s.spec_decode
        if spec is not None:  # vLLM's spec_decode counters, where the engine speculates
            counters += [("runlm:spec_decode_num_drafts", "Drafts verified.", spec.num_drafts),
                         ("runlm:spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
                         ("runlm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          spec.num_accepted_tokens)]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=label)
            c.add_metric([self.model_name], value)
            yield c
        per_replica = getattr(engine, "replica_stats", None)
        if per_replica is not None:  # data parallel: the same counts per replica, labelled engine="<rank>"
            yield from _replica_families(self.model_name, per_replica())
        if spec is not None:
            per_pos = CounterMetricFamily("runlm:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by their position in the draft.",
                                          labels=["model_name", "position"])
            for pos, value in enumerate(spec.accepted_per_position):
                per_pos.add_metric([self.model_name, str(pos)], value)
            yield per_pos


def _replica_families(model_name: str, per_replica: list[tuple[int, EngineStats]]) -> Iterator:
    """The families above summed over replicas stay as they are; these give each replica's share, every one
    labelled engine="<rank>" as vLLM labels its data-parallel series."""
    rows = (("num_requests_running", "Sequences running in each replica.", "num_running", GaugeMetricFamily),
            ("num_requests_waiting", "Sequences waiting in each replica.", "num_waiting", GaugeMetricFamily),
            ("kv_cache_usage_perc", "Fraction of each replica's KV-cache blocks in use.", "kv_cache_usage",
             GaugeMetricFamily),
            ("prefix_cache_queries", "Prompt tokens looked up in each replica's prefix cache.",
             "prefix_cache_queries", CounterMetricFamily),
            ("prefix_cache_hits", "Prompt tokens found in each replica's prefix cache.", "prefix_cache_hits",
             CounterMetricFamily),
            ("num_preemptions", "Sequences each replica preempted.", "num_preemptions", CounterMetricFamily),
            ("generation_tokens", "Tokens each replica generated.", "num_generation_tokens", CounterMetricFamily))
    for name, doc, field, family in rows:
        metric = family(f"runlm:replica_{name}", doc, labels=["model_name", "engine"])
        for rank, stats in per_replica:
            metric.add_metric([model_name, str(rank)], getattr(stats, field))
        yield metric


class ServerMetrics:
    def __init__(self, model_name: str, get_engine: Callable[[], AsyncLLM | None]) -> None:
        self.registry = CollectorRegistry()
        r, lbl = self.registry, ["model_name"]
        self.registry.register(_EngineCollector(get_engine, model_name))
        self.prompt_tokens = Counter("runlm:prompt_tokens", "Prompt tokens processed.", lbl,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("runlm:generation_tokens", "Tokens generated.", lbl,
                                         registry=r).labels(model_name)
        self.finished = Counter("runlm:request_success", "Engine requests finished, by reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.rejected = Counter("runlm:requests_rejected_queue_full", "Requests answered 503 (queue full).",
                                lbl, registry=r).labels(model_name)
        self.ttft = Histogram("runlm:time_to_first_token_seconds", "Time to first token.", lbl,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("runlm:inter_token_latency_seconds", "Time between output tokens.", lbl,
                             buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("runlm:e2e_request_latency_seconds", "End-to-end request latency.", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("runlm:request_queue_time_seconds", "Time waiting before first scheduled.",
                                    lbl, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.model_name = model_name

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(slots=True)
class RequestTimer:
    """Observes one engine request's outputs as they stream (timestamps from the engine's clock)."""
    metrics: ServerMetrics
    last_token_time: float | None = None

    def on_output(self, out: RequestOutput) -> None:
        m = self.metrics
        now = time.monotonic()
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            if self.last_token_time is None:
                if out.metrics is not None and out.metrics.first_token_time is not None:
                    m.ttft.observe(out.metrics.first_token_time - out.metrics.arrival_time)
            else:
                gap = (now - self.last_token_time) / new_tokens
                for _ in range(new_tokens):
                    m.itl.observe(gap)
            self.last_token_time = now
            m.generation_tokens.inc(new_tokens)
        if out.finished:
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            for c in out.outputs:
                m.finished.labels(m.model_name, c.finish_reason or "unknown").inc()
            rm = out.metrics
            if rm is not None:
                if rm.finished_time is not None:
                    m.e2e.observe(rm.finished_time - rm.arrival_time)
                if rm.first_scheduled_time is not None:
                    m.queue_time.observe(rm.first_scheduled_time - rm.arrival_time)

    def on_abort(self) -> None:
        m = self.metrics
        m.finished.labels(m.model_name, "abort").inc()
