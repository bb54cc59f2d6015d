from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runlm.image_generation.pipeline import ImageGenerator


@pytest.fixture(scope="session")
def generator(tiny_sd: Path) -> Iterator[ImageGenerator]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a few thousand parameters: a second thread only waits (and spins on a busy machine)
    yield ImageGenerator.load(tiny_sd)
    torch.set_num_threads(threads)
