"""The Python API after a step that ran out of memory (a real allocation failure: the process's address space capped,
in a child): ``LLM.generate`` raises StepOutOfMemoryError naming the cause, and the same engine generates again."""
from __future__ import annotations

import resource
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, resource, sys
    import psutil
    from runlm.engine.llm import LLM
    from runlm.engine.types.errors import StepOutOfMemoryError
    from runlm.engine.types.sampling_params import SamplingParams

    llm = LLM(sys.argv[1], max_num_batched_tokens=2048)
    small = SamplingParams(temperature=0.0, max_tokens=4)
    want = llm.generate([{"prompt_token_ids": [5, 6, 7]}], small)[0].outputs[0].token_ids
    vms = psutil.Process().memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (vms + (160 << 20), resource.RLIM_INFINITY))
    try:  # a 2000-token prompt's logprobs: [2000, 32000] float32, 256 MB
        llm.generate([{"prompt_token_ids": [100 + i for i in range(2000)]}],
                     SamplingParams(max_tokens=1, prompt_logprobs=1))
    except StepOutOfMemoryError as exc:
        print("raised:", exc)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], small)[0].outputs[0].token_ids == want
    print("generated again")
""")


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs Linux's RLIMIT_AS")
def test_generate_raises_and_the_engine_generates_again(tinycoder_gguf, monkeypatch):
    monkeypatch.setenv("RUNLM_NATIVE_RUNNER", "0")  # (the torch runner: torch's allocator)
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tinycoder_gguf)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "raised: the step computing this request ran out of memory" in run.stdout, run.stdout + run.stderr[-2000:]
    assert "generated again" in run.stdout
