"""The pipeline wrapper on a tiny random-weight Stable Diffusion pipeline: sizes, seeds, steps, schedulers."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from runlm.image_generation.pipeline import GenerationCancelled, ImageGenerator
from runlm.image_generation.request import ImageRequest, ImageRequestError, parse_request


def generate(generator: ImageGenerator, **fields) -> list:
    return generator.generate(generator.resolve(parse_request({"prompt": "a red cat", "steps": 2, **fields})))


def decode(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    return image


def test_images_are_pngs_of_the_requested_size(generator: ImageGenerator) -> None:
    images = generate(generator, size="48x32", n=2, seed=7)
    assert len(images) == 2 and [i.seed for i in images] == [7, 8]
    for img in images:
        assert decode(img.data).size == (48, 32) and (img.width, img.height) == (48, 32)
    # the pipeline's own size when none is asked for: the UNet's sample size times the VAE's scale factor
    (default,) = generate(generator, seed=1)
    assert decode(default.data).size == generator.default_size() == (32, 32)


def test_a_seed_fixes_the_image_and_two_seeds_differ(generator: ImageGenerator) -> None:
    first = generate(generator, size="32x32", seed=42)[0].data
    again = generate(generator, size="32x32", seed=42)[0].data
    other = generate(generator, size="32x32", seed=43)[0].data
    assert first == again
    assert first != other
    # image i of a request seeded s is the image of seed s + i, whatever n is
    pair = generate(generator, size="32x32", seed=42, n=2)
    assert pair[0].data == first and pair[1].data == other
    unseeded = generate(generator, size="32x32")[0]
    assert generate(generator, size="32x32", seed=unseeded.seed)[0].data == unseeded.data


def test_progress_reports_every_step_and_a_cancel_stops_it(generator: ImageGenerator) -> None:
    req = generator.resolve(parse_request({"prompt": "x", "steps": 3, "size": "16x16", "seed": 0}))
    seen: list[tuple[int, int]] = []
    generator.generate(req, on_step=lambda k, n: seen.append((k, n)))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    with pytest.raises(GenerationCancelled):
        generator.generate(req, on_step=lambda k, n: seen.append((k, n)), cancelled=lambda: len(seen) >= 4)
    assert len(seen) == 4  # stopped after the first step of the second run


def test_schedulers_are_the_pipelines_compatible_ones(generator: ImageGenerator) -> None:
    ddim = generate(generator, size="16x16", seed=3)[0].data
    euler = generate(generator, size="16x16", seed=3, scheduler="euler_discrete")[0].data
    assert generate(generator, size="16x16", seed=3, scheduler="EulerDiscreteScheduler")[0].data == euler
    assert euler != ddim
    assert type(generator.pipe.scheduler).__name__ == "DDIMScheduler"  # a request's choice does not stick
    with pytest.raises(ImageRequestError, match="unknown scheduler 'nope'") as err:
        generator.resolve(parse_request({"prompt": "x", "scheduler": "nope"}))
    assert err.value.param == "scheduler"


def test_jpeg_and_webp_output(generator: ImageGenerator) -> None:
    for fmt, magic in (("jpeg", b"\xff\xd8"), ("webp", b"RIFF")):
        (img,) = generate(generator, size="16x16", seed=1, output_format=fmt)
        assert img.data.startswith(magic)


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": "x", "size": "63x64"}, "size"),
    ({"prompt": "x", "size": "4096x512"}, "size"),
    ({"prompt": "x", "size": "0x8"}, "size"),
    ({"prompt": "x", "size": "big"}, "size"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 11}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "steps": 0}, "steps"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
    ({"prompt": "x", "response_format": "url"}, "response_format"),
    ({"prompt": "x", "output_format": "gif"}, "output_format"),
    ({"prompt": "x", "negative_prompt": 5}, "negative_prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
])
def test_bad_requests_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(ImageRequestError) as err:
        parse_request(fields)
    assert err.value.param == param


def test_good_requests_parse() -> None:
    req = parse_request({"prompt": "x", "size": "512x768", "n": 10, "response_format": "b64_json", "seed": 5,
                         "steps": 20, "guidance_scale": 7.5, "negative_prompt": "blurry", "quality": "hd",
                         "model": "m"})
    assert req == ImageRequest("x", n=10, width=512, height=768, seed=5, steps=20, guidance_scale=7.5,
                               negative_prompt="blurry")
    assert parse_request({"prompt": "x", "size": "auto"}).width is None


def test_pickled_weights_are_refused(tiny_sd: Path, tmp_path: Path) -> None:
    """A .bin file is a pickle, which runs code when loaded: the backend reads safetensors only."""
    import shutil

    from safetensors.torch import load_file

    copy = shutil.copytree(tiny_sd, tmp_path / "pipe")
    unet = copy / "unet"
    torch.save(load_file(unet / "diffusion_pytorch_model.safetensors"), unet / "diffusion_pytorch_model.bin")
    (unet / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(Exception, match="safetensors"):
        ImageGenerator.load(copy)
