"""`runlm serve-engine --tensor-parallel-size 2`: a real server over two real ranks answers the official client
with the unsplit model's greedy tokens, and says 503 on /health once a rank dies (what the daemon restarts on)."""
from __future__ import annotations

import time

import httpx
import openai
import psutil

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids
from tests.server.process import ServerProcess


def test_a_split_server_answers_and_reports_a_dead_rank(tiny_model) -> None:
    path = str(tiny_model("llama"))
    prompt = prompt_ids(12, seed=3)
    expected = LLM(path, exact_numerics=True, kv_cache_memory="64MiB").generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    server = ServerProcess(path, ["--tensor-parallel-size", "2", "--exact-numerics", "--kv-cache-memory", "64MiB"])
    server.start()
    try:
        assert "tensor-parallel torch" in "".join(server.log)  # the start-up line names the runner
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        done = client.completions.create(model=path, prompt=prompt, max_tokens=8, temperature=0.0,
                                         extra_body={"ignore_eos": True})
        assert done.choices[0].text == expected[0].outputs[0].text
        assert server.proc is not None
        workers = psutil.Process(server.proc.pid).children()
        assert len(workers) == 1
        workers[0].kill()  # (its parent, the server, reaps it: the health check's poll sees it gone)
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{server.url}/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "the server still says healthy"
            time.sleep(0.1)
        assert health.status_code == 503
        assert "rank 1 exited" in health.json()["error"]["message"]
    finally:
        server.stop()
