"""runlm's ``/infill`` prompt against llama-server's own, built from the llama.cpp sources the bench uses
(``cmake --build .cache/llama-server-build --target llama-server``; skipped where it is not built): for the same
requests on the same GGUF and context, the same prompt text and the same number of prompt tokens — with files in
``input_extra``, a prefix past the batch's share, a context too small for the extra files, and a vocabulary
without repository tokens."""
from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fixtures.models import fim_gguf
from tests.runner.daemon import free_port
from tests.server.process import ServerProcess

LLAMA_SERVER = Path(__file__).resolve().parents[2] / ".cache" / "llama-server-build" / "bin" / "llama-server"
pytestmark = pytest.mark.skipif(not LLAMA_SERVER.is_file(), reason="llama-server is not built (see the docstring)")

EXTRA = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"},
         {"filename": "consts.py", "text": "PI = 3.14159\nE = 2.71828\n"}]
REQUESTS = [
    {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "prompt": "return"},
    {"input_prefix": "import os\n", "input_suffix": "", "input_extra": EXTRA},
    {"input_prefix": "x = 1\n" * 700, "input_suffix": "y = 2\n" * 300, "input_extra": EXTRA, "prompt": "z"},
]


class LlamaServer:
    def __init__(self, model: Path, context: int) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([str(LLAMA_SERVER), "-m", str(model), "--port", str(self.port), "-c",
                                      str(context), "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("llama-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module", params=[("qwen", 8192), ("qwen", 2048), ("starcoder", 8192)],
                ids=["qwen-8192", "qwen-2048", "starcoder"])
def servers(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    style, context = request.param
    model = fim_gguf(style)
    theirs = LlamaServer(model, context)
    ours = ServerProcess(str(model), ["--max-model-len", str(context), "--kv-cache-memory", "64MiB"]).start()
    yield ours.url, theirs.url
    ours.stop()
    theirs.stop()


@pytest.mark.parametrize("body", REQUESTS, ids=["prompt", "extra", "truncated"])
def test_the_infill_prompt_is_llama_servers(servers: tuple[str, str], body: dict) -> None:
    answers = [httpx.post(f"{url}/infill", json={**body, "n_predict": 1, "temperature": 0}, timeout=120)
               for url in servers]
    ours, theirs = (a.json() for a in answers)
    if answers[1].status_code == 400:  # a prompt past the context: both refuse it, counting the same tokens
        assert answers[0].status_code == 400 and "context_length_exceeded" in answers[0].text
        assert f"is {theirs['error']['n_prompt_tokens']} tokens" in ours["error"]["message"]
        return
    assert ours["prompt"] == theirs["prompt"]
    assert ours["tokens_evaluated"] == theirs["tokens_evaluated"]
