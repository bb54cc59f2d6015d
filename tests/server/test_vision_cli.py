"""``runlm run MODEL PROMPT --image FILE`` without a daemon: the model loads in this process and answers from the
image; a file that is not an image, or an image for a text-only model, is a one-line error."""
from __future__ import annotations

from pathlib import Path

from tests.fixtures.vlm import png_bytes, test_image, vlm_dir
from tests.runner.daemon import runlm


def test_run_with_images_in_process(tmp_path: Path) -> None:
    picture = tmp_path / "cat.png"
    picture.write_bytes(png_bytes(test_image(96, 64, seed=0)))
    model = str(vlm_dir("idefics3"))
    ok = runlm(tmp_path / "home", "run", model, "Describe", "the", "picture", "--image", str(picture),
               "--image", str(picture), "--max-tokens", "3", "--temperature", "0")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip()
    (tmp_path / "notes.txt").write_text("not a picture")
    bad = runlm(tmp_path / "home", "run", model, "Describe", "--image", str(tmp_path / "notes.txt"))
    assert bad.returncode == 2 and "notes.txt" in bad.stderr and "not an image" in bad.stderr
    missing = runlm(tmp_path / "home", "run", model, "Describe", "--image", str(tmp_path / "nope.png"))
    assert missing.returncode == 2 and "nope.png" in missing.stderr


def test_run_with_an_image_on_a_text_only_model(tmp_path: Path) -> None:
    picture = tmp_path / "cat.png"
    picture.write_bytes(png_bytes(test_image(32, 32)))
    res = runlm(tmp_path / "home", "run", "tinycoder", "Describe", "--image", str(picture), "--max-tokens", "2")
    assert res.returncode == 1 and "does not accept images" in res.stderr, res.stderr
