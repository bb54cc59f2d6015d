"""serve-engine with speculative decoding (issue 13): vLLM's --speculative-config and its shorthands, the
spec_decode counters on /metrics, a bad config refused at start; the runner's native backend passing
Model Runner's ``speculative`` object on."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from runlm.runner.backends.native import NativeBackend
from runlm.runner.config import BackendConfig, SpeculativeConfig
from tests.server.process import ServerProcess
from tests.server.test_load import metrics


@pytest.fixture(scope="module")
def server(tiny_model):
    path = str(tiny_model("qwen2"))
    s = ServerProcess(path, ["--served-model-name", "tiny", "--max-model-len", "256", "--kv-cache-memory", "32MiB",
                             "--draft-model", path, "--num-speculative-tokens", "3"]).start()
    yield s
    s.stop()


def test_metrics_count_drafts_and_accepted_tokens(server) -> None:
    r = httpx.post(f"{server.base_url}/completions", timeout=60,
                   json={"model": "tiny", "prompt": "speculate", "max_tokens": 12, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    m = metrics(server)
    # the draft is the target itself: every draft token is accepted
    assert m["runlm:spec_decode_num_drafts_total"] >= 3
    assert m["runlm:spec_decode_num_accepted_tokens_total"] == m["runlm:spec_decode_num_draft_tokens_total"] > 0
    text = httpx.get(f"{server.url}/metrics").text
    assert 'runlm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"}' in text


@pytest.mark.parametrize("flags,message", [
    (["--speculative-config", "{not json"], "not JSON"),
    (["--speculative-config", '{"method": "medusa"}'], "method must be one of"),
])
def test_a_bad_speculative_config_stops_the_server_with_a_message(flags: list[str], message: str,
                                                                  tiny_model) -> None:
    done = subprocess.run([sys.executable, "-m", "runlm.cli", "serve-engine", str(tiny_model("qwen2")), "--port", "0",
                           *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and message in done.stderr, done.stderr


def test_native_backend_passes_model_runners_speculative_object(tmp_path) -> None:
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"0" * 1000)
    backend = NativeBackend(tmp_path)
    spec = SpeculativeConfig("draft", num_tokens=3, min_acceptance_rate=0.25, draft_model_path=str(draft))
    argv = backend.command("/tmp/s.sock", "/models/target.gguf", "target", None, BackendConfig(speculative=spec))
    value = json.loads(argv[argv.index("--speculative-config") + 1])
    assert value == {"model": str(draft), "num_speculative_tokens": 3, "min_acceptance_rate": 0.25}
    backend.check_config(BackendConfig(speculative=spec))  # no longer refused for the native backend
