"""serve-engine's data-parallel and profiling routes through a real server: POST /scale_elastic_ep (vLLM's
route, behind the API key) while the openai client's requests flow, per-replica /metrics, and
/start_profile + /stop_profile writing one trace per replica."""
from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY
from tests.server.process import ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_an_in_process_engine_cannot_scale_and_profiling_needs_a_directory(smollm2_server) -> None:
    url = smollm2_server.url
    assert httpx.post(f"{url}/scale_elastic_ep", json={"new_data_parallel_size": 2}).status_code == 401
    r = httpx.post(f"{url}/scale_elastic_ep", json={"new_data_parallel_size": 2}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "data_parallel_not_enabled"
    r = httpx.post(f"{url}/scale_elastic_ep", json={"new_data_parallel_size": 0}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "new_data_parallel_size"
    assert httpx.post(f"{url}/start_profile").status_code == 401
    r = httpx.post(f"{url}/start_profile", headers=AUTH)
    assert r.status_code == 400 and "--profiler-dir" in r.json()["error"]["message"]
    body = {"model": "smollm2", "prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{smollm2_server.base_url}/completions", json=body,
                   headers=AUTH | {"X-data-parallel-rank": "3"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-data-parallel-rank"
    client = openai.OpenAI(base_url=smollm2_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    out = client.completions.create(model="smollm2", prompt="hi", max_tokens=2,
                                    extra_headers={"X-data-parallel-rank": "0"})  # the in-process engine is rank 0
    assert out.choices[0].text is not None


@pytest.fixture(scope="module")
def dp_server(tiny_model, tmp_path_factory):
    traces = tmp_path_factory.mktemp("traces")
    server = ServerProcess(str(tiny_model("qwen2")), [
        "--data-parallel-size", "1", "--distributed-executor-backend", "mp", "--threads", "2",
        "--api-key", API_KEY, "--served-model-name", "tiny", "--kv-cache-memory", "64MiB",
        "--profiler-dir", str(traces)]).start()
    server.traces = traces  # type: ignore[attr-defined]
    yield server
    server.stop()


def _replica_lines(url: str) -> list[str]:
    text = httpx.get(f"{url}/metrics").text
    return [line for line in text.splitlines() if line.startswith("runlm:replica_num_requests_running{")]


@pytest.mark.slow
def test_scale_1_2_1_under_traffic_loses_no_request(dp_server) -> None:
    client = openai.OpenAI(base_url=dp_server.base_url, api_key=API_KEY, max_retries=0, timeout=120)

    def complete(i: int) -> str:
        out = client.completions.create(model="tiny", prompt=f"request {i}", max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
        return out.choices[0].finish_reason

    url = dp_server.url
    r = httpx.post(f"{url}/scale_elastic_ep", json={"new_data_parallel_size": "two"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["type"]
    assert len(_replica_lines(url)) == 1
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = [pool.submit(complete, i) for i in range(8)]
        up = httpx.post(f"{url}/scale_elastic_ep", json={"new_data_parallel_size": 2}, headers=AUTH, timeout=300)
        assert up.status_code == 200 and up.json()["data_parallel_size"] == 2
        assert len(_replica_lines(url)) == 2  # engine="0" and engine="1"
        pinned = client.completions.with_raw_response.create(model="tiny", prompt="pinned", max_tokens=2,
                                                             extra_headers={"X-data-parallel-rank": "1"})
        assert pinned.http_response.status_code == 200
        second = [pool.submit(complete, i) for i in range(8, 24)]
        down = httpx.post(f"{url}/scale_elastic_ep", json={"new_data_parallel_size": 1}, headers=AUTH,
                          timeout=300)
        assert down.status_code == 200 and down.json()["data_parallel_size"] == 1
        reasons = [f.result() for f in first + second]
    assert reasons == ["length"] * 24
    assert len(_replica_lines(url)) == 1 and complete(99) == "length"


@pytest.mark.slow
def test_profile_routes_write_a_trace_per_replica(dp_server) -> None:
    url = dp_server.url
    assert httpx.post(f"{url}/stop_profile").status_code == 401
    assert httpx.post(f"{url}/start_profile", headers=AUTH, timeout=120).status_code == 200  # kineto starts slowly
    client = openai.OpenAI(base_url=dp_server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    client.completions.create(model="tiny", prompt="profile", max_tokens=4)
    r = httpx.post(f"{url}/stop_profile", headers=AUTH, timeout=120)
    assert r.status_code == 200
    names = r.json()["traces"]
    assert len(names) == 1 and "/" not in names[0]
    events = json.loads((Path(dp_server.traces) / names[0]).read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("runlm::forward") for e in events)


def test_every_replica_series_is_labelled_by_engine_rank(tiny_model) -> None:
    """With --data-parallel-size 2 each replica's series, generated tokens included, carry engine="<rank>"."""
    import re
    import time

    server = ServerProcess(str(tiny_model("qwen2")), ["--data-parallel-size", "2", "--threads", "2",
                                                      "--served-model-name", "tiny", "--kv-cache-memory", "64MiB"])
    server.start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        for rank, tokens in ((0, 3), (1, 5)):
            client.completions.create(model="tiny", prompt="hi", max_tokens=tokens, temperature=0,
                                      extra_body={"ignore_eos": True},
                                      extra_headers={"X-data-parallel-rank": str(rank)})
        deadline, found = time.monotonic() + 30, {}
        while time.monotonic() < deadline:
            text = httpx.get(f"{server.url}/metrics").text
            found = {m.group(1): float(m.group(2)) for m in re.finditer(
                r'^runlm:replica_generation_tokens_total\{[^}]*engine="(\d+)"[^}]*\} (\S+)$', text, re.M)}
            if found == {"0": 3.0, "1": 5.0}:
                break
            time.sleep(0.5)
        assert found == {"0": 3.0, "1": 5.0}, text
        replica = [line for line in text.splitlines() if line.startswith("runlm:replica_")]
        assert replica and all('engine="' in line for line in replica)
        names = {line.split("{")[0] for line in replica}
        assert {"runlm:replica_num_requests_running", "runlm:replica_kv_cache_usage_perc",
                "runlm:replica_generation_tokens_total", "runlm:replica_num_preemptions_total"} <= names
    finally:
        server.stop()
