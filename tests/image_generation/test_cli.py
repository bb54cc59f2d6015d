"""`runlm generate-image` without a daemon: the CLI loads the pipeline from the store itself."""
from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from runlm.store import ModelStore
from tests.runner.daemon import runlm


@pytest.mark.slow  # a process of its own that imports diffusers and loads the pipeline: ~30 s on 2 busy cores
def test_generate_image_in_process(tiny_sd: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    ModelStore(home).pull(str(tiny_sd), "tiny-sd")
    out = runlm(home, "generate-image", "tiny-sd", "a", "cat", "-o", str(tmp_path / "cat.png"), "-n", "2",
                "--steps", "2", "--seed", "9", "--size", "24x16", "--scheduler", "euler_discrete")
    assert out.returncode == 0, out.stderr
    first, second = tmp_path / "cat-1.png", tmp_path / "cat-2.png"
    assert Image.open(first).size == Image.open(second).size == (24, 16)
    assert "seed 9" in out.stdout and "seed 10" in out.stdout and "step 2/2" in out.stderr
    bad = runlm(home, "generate-image", "tiny-sd", "x", "--size", "30x30", "--steps", "1")
    assert bad.returncode == 2 and "multiples of 8" in bad.stderr
    missing = runlm(home, "generate-image", "nope", "x")
    assert missing.returncode == 1 and "not found" in missing.stderr
