"""The vision families' registry: each family module agrees with the table the store reads without
importing it, and images are decoded as transformers' processors see them."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from PIL import Image

from runlm.models.vision import FAMILIES, family_module, hf_family, is_vision_config
from runlm.models.vision.images import ImageError, open_image
from tests.fixtures.vlm import png_bytes, test_image


@pytest.mark.parametrize("name", [f for f in FAMILIES if importlib.util.find_spec(f"runlm.models.vision.{f}")])
def test_family_modules_agree_with_the_table(name: str) -> None:
    module = family_module(name)
    assert (tuple(module.MODEL_TYPES), tuple(module.PROJECTOR_TYPES)) == FAMILIES[name]
    for model_type in module.MODEL_TYPES:
        assert is_vision_config({"model_type": model_type}) and hf_family({"model_type": model_type}) is module
    assert not is_vision_config({"model_type": "llama"}) and hf_family({"model_type": "llama"}) is None


def test_transparent_images_are_laid_over_white_as_transformers_does() -> None:
    from transformers.image_transforms import convert_to_rgb

    rgba = Image.fromarray(np.dstack([np.asarray(test_image(32, 16)), np.tile(np.arange(0, 256, 8, dtype=np.uint8),
                                                                                 (16, 1))]), "RGBA")
    ours = open_image(png_bytes(rgba))
    assert ours.mode == "RGB" and np.array_equal(np.asarray(ours), np.asarray(convert_to_rgb(rgba)))


def test_images_that_cannot_be_used_are_refused_by_what_is_wrong() -> None:
    with pytest.raises(ImageError, match="not an image"):
        open_image(b"plain text, not a picture")
    with pytest.raises(ImageError, match="truncated|decoded"):
        open_image(png_bytes(test_image(64, 64))[:100])
    with pytest.raises(ImageError, match="bytes"):
        open_image(png_bytes(test_image(64, 64)), max_bytes=100)
    with pytest.raises(ImageError, match="pixels"):
        open_image(png_bytes(test_image(64, 64)), max_pixels=64 * 63)
    with pytest.raises(ImageError, match="bytes or a PIL image"):
        open_image("a path")  # type: ignore[arg-type]
