"""`runlm serve-engine --n-gpu-layers K` (layer offload) on the GPU runner's CPU path: the official client gets the
unsplit model's greedy tokens, and the start-up log names the split."""
from __future__ import annotations

import openai

from runlm.engine.llm import LLM
from runlm.engine.types.sampling_params import SamplingParams
from tests.engine.conftest import prompt_ids
from tests.server.process import ServerProcess

GPU_RUNNER = {"RUNLM_GPU_RUNNER": "1", "RUNLM_NATIVE_RUNNER": "0"}


def test_a_server_with_offloaded_layers_answers(tiny_model, monkeypatch) -> None:
    path = str(tiny_model("qwen2"))
    prompt = prompt_ids(12, seed=4)
    for name, value in GPU_RUNNER.items():
        monkeypatch.setenv(name, value)
    expected = LLM(path, kv_cache_memory="64MiB").generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    server = ServerProcess(path, ["--n-gpu-layers", "1", "--kv-cache-memory", "64MiB"], env=GPU_RUNNER)
    server.start()
    try:
        log = "".join(server.log)
        assert "1 of 2 layers on cpu: layers 0-0 on the CPU" in log, log[-2000:]
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        done = client.completions.create(model=path, prompt=prompt, max_tokens=8, temperature=0.0,
                                         extra_body={"ignore_eos": True})
        assert done.choices[0].text == expected[0].outputs[0].text
    finally:
        server.stop()
