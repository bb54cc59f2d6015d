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


@pytest.mark.parametrize(("error", "recoverable"), [
    (MemoryError(), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.11 GiB total capacity)"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory"), True),
    # a lost CUDA context: the engine must die (its /health fails and the daemon replaces the backend), not retry
    (RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                  "asynchronously reported at some other API call"), False),
    (RuntimeError("CUDA error: device-side assert triggered"), False),
    ("AcceleratorError", False),   # what torch raises for a CUDA error (a RuntimeError)
    ("OutOfMemoryError", True),    # ... and for a failed CUDA allocation
    (RuntimeError("CUDA error: unspecified launch failure"), False),
])
def test_only_a_failed_allocation_is_survived(error: BaseException | str, recoverable: bool) -> None:
    import torch

    from runlm.engine.llm_engine import out_of_memory

    if isinstance(error, str):
        error = getattr(torch, error)("CUDA error: an illegal memory access was encountered" if not recoverable
                                      else "CUDA out of memory. Tried to allocate 2.00 GiB")
    assert out_of_memory(error) is recoverable
