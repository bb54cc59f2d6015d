"""A GPU run compiles and loads no CPU kernel (issue 39: 32 of a cold load's 38 s on an H100 went to building
them): the torch-level entry points ask for their C++ kernel only for CPU tensors, and the start line asks only the
device's own kernels. Off the CPU is the "meta" device here (a real GPU's run is tests/engine/test_gpu_cuda.py's);
a child process with every CPU kernel's build replaced by a failure shows any that is asked for."""
from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import torch
from runlm.kernels import build

asked = []
def refuse(self):
    asked.append(self.name)
    return False
build.LazyKernel.available = refuse

from runlm.engine.engine_core import kernel_kinds
from runlm.kernels import attention, linear, linear_q8

meta = dict(device="meta")
x, w = torch.empty(3, 64, **meta), torch.empty(8, 64, **meta)
assert linear(x, w).shape == (3, 8)
assert linear_q8(x, torch.empty(8, 64, dtype=torch.int8, **meta), torch.empty(8, 2, **meta),
                 torch.empty(8, 2, **meta)).shape == (3, 8)
assert attention.paged_attention(torch.empty(2, 4, 16, **meta), torch.empty(8, 2, 16, **meta),
                                 torch.empty(8, 2, 16, **meta), torch.zeros(2, dtype=torch.long), [2], [2], 0.25) is None
kinds = kernel_kinds("cuda")
assert not asked, asked
linear(torch.ones(2, 64), torch.ones(8, 64))  # a CPU tensor does ask: the check can fail
assert asked == ["runlm_linear"], asked
print("ok", kinds)
"""


def test_off_the_cpu_no_cpu_kernel_is_asked_for():
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr[-3000:]
