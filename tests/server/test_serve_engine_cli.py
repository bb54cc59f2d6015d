"""``runlm serve-engine`` as the runner starts it: a Unix socket, readiness, clean exits."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import httpx

from tests.server.process import ENV

RUNLM = [sys.executable, "-m", "runlm.cli", "serve-engine"]


def test_unix_socket_private_and_serving(tmp_path, tiny_model) -> None:
    sock = tmp_path / "backend.sock"
    proc = subprocess.Popen([*RUNLM, str(tiny_model("qwen2")), "--uds", str(sock), "--served-model-name", "tiny",
                             "--kv-cache-memory", "64MiB"], env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(transport=transport, base_url="http://backend", timeout=60) as c:
            deadline = time.monotonic() + 120
            seen_loading = False
            while True:
                assert proc.poll() is None, proc.stderr.read()
                try:
                    r = c.get("/health")
                    if r.status_code == 200:
                        break
                    assert r.status_code == 503 and r.headers["retry-after"]
                    assert c.get("/liveness").status_code == 200
                    # the model may finish loading between the two probes: then readiness is already 200
                    ready = c.get("/readiness")
                    assert ready.status_code == 503 and ready.headers["retry-after"] or ready.status_code == 200
                    seen_loading = True
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3,
                                                "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert c.post("/v1/completions", json={"model": "smollm2", "prompt": "x"}).status_code == 421
            assert c.get("/readiness").status_code == 200
        del seen_loading  # loading may finish before the first probe on a fast machine
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert not sock.exists()  # removed on exit


def test_unknown_model_exits_1_with_the_list() -> None:
    res = subprocess.run([*RUNLM, "no-such-model", "--port", "0"], env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1 and "no-such-model" in res.stderr and "smollm2" in res.stderr


def test_model_that_cannot_generate_exits_1(minilm_dir) -> None:
    # minilm is served for embeddings by default; asked to generate, it fails to load
    res = subprocess.run([*RUNLM, str(minilm_dir), "--port", "0", "--task", "generate"], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "failed to load" in res.stderr and "embedding" in res.stderr


def test_refuses_to_replace_a_file_with_its_socket(tmp_path) -> None:
    victim = tmp_path / "important.txt"
    victim.write_text("keep me")
    res = subprocess.run([*RUNLM, "smollm2", "--uds", str(victim)], env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1 and "not a socket" in res.stderr and victim.read_text() == "keep me"


def test_a_q8_0_kv_cache_where_torch_would_run_exits_1_saying_why(tiny_model) -> None:
    # --kv-cache-dtype q8_0 is the native runner's; exact numerics run on torch
    res = subprocess.run([*RUNLM, str(tiny_model("qwen2")), "--port", "0", "--kv-cache-dtype", "q8_0",
                          "--exact-numerics"], env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "kv_cache_dtype 'q8_0' needs the native runner" in res.stderr
    assert "exact numerics" in res.stderr
    res = subprocess.run([*RUNLM, "smollm2", "--port", "0", "--kv-cache-dtype", "fp4"], env=ENV, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "--kv-cache-dtype" in res.stderr
    # fp8 is the GPU runner's: on a CPU it names where it runs
    res = subprocess.run([*RUNLM, str(tiny_model("qwen2")), "--port", "0", "--kv-cache-dtype", "fp8"], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "gpu runner, which runs on a GPU (--device cuda)" in res.stderr
