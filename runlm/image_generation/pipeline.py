"""One diffusers pipeline, loaded once, generating images for checked requests one batch at a time.

Reproducible by construction: image ``i`` of a request with seed ``s`` starts from the noise of a
CPU ``torch.Generator`` seeded ``s + i`` (on every device: diffusers draws the noise on the
generator's device and moves it), so one seed gives the same image whatever ``n`` is, and the
same bytes on the same machine. A pipeline is not thread-safe: callers run ``generate`` from one
thread (the server's single worker).
"""
from __future__ import annotations

import inspect
import io
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from runlm.image_generation.request import MAX_SEED, OUTPUT_FORMATS, SIDE_MULTIPLE, ImageRequest, ImageRequestError

log = logging.getLogger("runlm.image_generation")

StepCallback = Callable[[int, int], None]  # (steps done, steps in all)


class GenerationCancelled(Exception):
    """The client went away: the pipeline stops at the next step."""


@dataclass(slots=True, frozen=True)
class GeneratedImage:
    data: bytes   # the encoded file (PNG unless asked otherwise)
    seed: int
    width: int
    height: int


def _scheduler_key(name: str) -> str:
    """'EulerDiscreteScheduler', 'euler_discrete' and 'EulerDiscrete' name one scheduler."""
    key = name.lower().replace("_", "").replace("-", "")
    return key.removesuffix("scheduler")


class ImageGenerator:
    def __init__(self, pipeline: Any, device: str = "cpu") -> None:
        self.pipe = pipeline
        self.device = device
        self.pipe.set_progress_bar_config(disable=True)  # progress goes to our log and stream instead
        self._params = inspect.signature(self.pipe.__call__).parameters
        self._default_scheduler = self.pipe.scheduler
        self.schedulers = {_scheduler_key(c.__name__): c for c in self.pipe.scheduler.compatibles}
        self.schedulers[_scheduler_key(type(self.pipe.scheduler).__name__)] = type(self.pipe.scheduler)

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", dtype: str | None = None) -> ImageGenerator:
        import torch
        from diffusers import DiffusionPipeline

        # fp32 on CPU, where half-precision convolutions are many times slower; fp16 on a GPU
        torch_dtype = getattr(torch, dtype) if dtype else (torch.float32 if device == "cpu" else torch.float16)
        # safetensors only: a pickled .bin would run code on load; no remote code either (diffusers' default)
        pipe = DiffusionPipeline.from_pretrained(str(path), dtype=torch_dtype, local_files_only=True,
                                                 use_safetensors=True, trust_remote_code=False)
        return cls(pipe.to(device), device)

    @property
    def class_name(self) -> str:
        return type(self.pipe).__name__

    @property
    def vae_scale_factor(self) -> int:
        return int(getattr(self.pipe, "vae_scale_factor", SIDE_MULTIPLE) or SIDE_MULTIPLE)

    def default_size(self) -> tuple[int, int]:
        sample = getattr(self.pipe, "default_sample_size", None)
        if sample is None:
            denoiser = getattr(self.pipe, "unet", None) or getattr(self.pipe, "transformer", None)
            sample = getattr(getattr(denoiser, "config", None), "sample_size", None) or 64
        if isinstance(sample, (list, tuple)):
            sample = sample[0]
        side = int(sample) * self.vae_scale_factor
        return side, side

    def default_steps(self) -> int:
        param = self._params.get("num_inference_steps")
        return int(param.default) if param is not None and isinstance(param.default, int) else 50

    def resolve(self, req: ImageRequest) -> ImageRequest:
        """The request with the pipeline's defaults filled in; ImageRequestError for what this pipeline cannot do."""
        if req.scheduler is not None and _scheduler_key(req.scheduler) not in self.schedulers:
            names = ", ".join(sorted(c.__name__ for c in self.schedulers.values()))
            raise ImageRequestError(f"unknown scheduler {req.scheduler!r} for {self.class_name} (it takes: {names})",
                                    "scheduler")
        for field, param in (("negative_prompt", "negative_prompt"), ("guidance_scale", "guidance_scale")):
            if getattr(req, field) is not None and param not in self._params:
                raise ImageRequestError(f"{self.class_name} takes no {field}", field)
        width, height = (req.width, req.height) if req.width and req.height else self.default_size()
        multiple = max(SIDE_MULTIPLE, self.vae_scale_factor)
        if width % multiple or height % multiple:
            raise ImageRequestError(f"size {width}x{height}: {self.class_name} needs multiples of {multiple}", "size")
        seed = req.seed if req.seed is not None else random.randint(0, MAX_SEED - req.n)
        if seed + req.n - 1 > MAX_SEED:
            raise ImageRequestError(f"seed + n - 1 must not exceed {MAX_SEED}", "seed")
        return replace(req, width=width, height=height, seed=seed, steps=req.steps or self.default_steps())

    def generate(self, req: ImageRequest, on_step: StepCallback | None = None,
                 cancelled: Callable[[], bool] | None = None) -> list[GeneratedImage]:
        """Images for a request already through ``resolve``."""
        import torch

        assert req.width and req.height and req.seed is not None and req.steps
        kwargs: dict[str, Any] = dict(prompt=req.prompt, width=req.width, height=req.height,
                                      num_inference_steps=req.steps, num_images_per_prompt=req.n, output_type="pil",
                                      generator=[torch.Generator("cpu").manual_seed(req.seed + i)
                                                 for i in range(req.n)])
        if req.negative_prompt is not None:
            kwargs["negative_prompt"] = req.negative_prompt
        if req.guidance_scale is not None:
            kwargs["guidance_scale"] = req.guidance_scale
        started = time.monotonic()
        label = f"{req.n} image{'s' if req.n > 1 else ''} {req.width}x{req.height}"

        def step_end(pipe: Any, step: int, timestep: Any, tensors: dict) -> dict:
            if cancelled is not None and cancelled():
                raise GenerationCancelled
            log.info("%s: step %d of %d", label, step + 1, req.steps)
            if on_step is not None:
                on_step(step + 1, req.steps or 0)
            return tensors

        if "callback_on_step_end" in self._params:
            kwargs["callback_on_step_end"] = step_end
        if req.scheduler is not None:
            chosen = self.schedulers[_scheduler_key(req.scheduler)]
            self.pipe.scheduler = chosen.from_config(self._default_scheduler.config)
        try:
            with torch.inference_mode():
                images = self.pipe(**kwargs).images
        finally:
            self.pipe.scheduler = self._default_scheduler
        log.info("%s: done in %.2f s", label, time.monotonic() - started)
        return [GeneratedImage(encode(img, req.output_format), req.seed + i, img.width, img.height)
                for i, img in enumerate(images)]


def encode(image: Any, output_format: str = "png") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=OUTPUT_FORMATS[output_format])
    return buf.getvalue()
