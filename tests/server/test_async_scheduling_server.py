"""`runlm serve-engine` on the GPU runner's CPU path with async scheduling (its default): the official client's
streams, in parallel and with stop strings, carry the text a runner waiting for each step gives; a client that
walks away mid-stream (its request aborted while its next token is being drawn) leaves the server answering."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids
from tests.server.process import ServerProcess

GPU_RUNNER = {"RUNLM_GPU_RUNNER": "1", "RUNLM_NATIVE_RUNNER": "0"}


def test_streams_and_aborts_through_an_async_scheduling_server(tiny_model, monkeypatch) -> None:
    path = str(tiny_model("qwen2"))
    for name, value in GPU_RUNNER.items():
        monkeypatch.setenv(name, value)
    prompts = [prompt_ids(6 + 3 * i, seed=30 + i) for i in range(4)]
    waiting = LLM(path, kv_cache_memory="64MiB", async_scheduling=False)
    free = waiting.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    text = free[1].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # (ends request 1 mid-run; the others where it first appears)
    want = [o.outputs[0].text for o in waiting.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]))]
    server = ServerProcess(path, ["--kv-cache-memory", "64MiB"], env=GPU_RUNNER)
    server.start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")

        def streamed(prompt: list[int]) -> str:
            chunks = client.completions.create(model=path, prompt=prompt, max_tokens=12, temperature=0.0, stop=[stop],
                                               stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(streamed, prompts)) == want
        walked_away = client.completions.create(model=path, prompt=prompts[0], max_tokens=200, temperature=0.0,
                                                stream=True, extra_body={"ignore_eos": True})
        next(iter(walked_away))
        walked_away.close()
        assert streamed(prompts[2]) == want[2]
        log = "".join(server.log)
        assert "(async scheduling)" in log and "Traceback" not in log, log[-2000:]
    finally:
        server.stop()
