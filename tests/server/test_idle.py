"""A loaded, idle server costs nothing: its kernel threads sleep rather than spin between requests."""
from __future__ import annotations

import time

import httpx
import psutil

from tests.server.conftest import API_KEY


def test_an_idle_loaded_server_uses_under_two_percent_of_a_cpu(smollm2_server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{smollm2_server.url}/v1/completions", headers=headers, timeout=120,
                   json={"model": "smollm2", "prompt": "Hello", "max_tokens": 8})
    assert r.status_code == 200
    process = psutil.Process(smollm2_server.proc.pid)
    time.sleep(1.0)  # let the request's threads finish and park
    process.cpu_percent(None)
    time.sleep(4.0)
    assert process.cpu_percent(None) < 2.0
