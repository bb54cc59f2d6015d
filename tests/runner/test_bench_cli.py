"""``runlm bench`` against a real daemon (tinycoder): every level runs, token counts are exact, the JSON and the
table say the same, and --plot writes a PNG."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runner.daemon import Daemon, runlm


def test_bench_levels_json_table_and_plot(daemon: Daemon, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    # the daemon found through RUNLM_HOME (no --url), as a user runs it
    r = runlm(daemon.home, "bench", "tinycoder", "--concurrency", "1", "2", "--output-len", "3", "5",
              "--requests", "2", "--json", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = out["results"]
    assert [(x["concurrency"], x["output_len"]) for x in rows] == [(1, 3), (2, 3), (1, 5), (2, 5)]
    for x in rows:
        assert x["completed"] == 2 and x["failed"] == 0
        assert x["output_tokens"] == 2 * x["output_len"]  # end-of-sequence ignored: exact lengths
        assert 0 < x["ttft_p50_ms"] <= x["ttft_p99_ms"] and x["itl_p50_ms"] > 0 and x["output_tok_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = runlm(daemon.home, "bench", "tinycoder", "--url", daemon.url, "--concurrency", "2", "--output-len", "2",
                  "--requests", "2")
    assert table.returncode == 0, table.stderr
    head, row = table.stdout.splitlines()[1:3]
    assert head.split()[:5] == ["CONC", "OUT", "OK", "TOK/S", "REQ/S"] and "TTFT" in head
    assert row.split()[:3] == ["2", "2", "2/2"]
    bad = runlm(daemon.home, "bench", "no-such-model", "--url", daemon.url, "--concurrency", "1")
    assert bad.returncode != 0 and "warm-up request failed" in bad.stderr
