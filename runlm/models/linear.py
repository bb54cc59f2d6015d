"""The linear layer every model uses: runlm's batch-invariant kernel where it applies.

``runlm.kernels.linear`` reduces each output in one fixed order whatever the batch, so a
sequence's logits do not change with what else is in the step; anything the kernel does not
cover (another dtype or device, no compiler) runs torch's own ``F.linear``.
"""
from __future__ import annotations

import torch
from torch import nn

from runlm.kernels import linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
