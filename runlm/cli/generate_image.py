"""``runlm generate-image MODEL PROMPT -o out.png``: through the daemon when one runs, else in this process."""
from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runlm.cli.client import CLIError, Daemon, connect, error_message


def _outputs(output: str, n: int) -> list[Path]:
    path = Path(output)
    return [path] if n == 1 else [path.with_name(f"{path.stem}-{i + 1}{path.suffix}") for i in range(n)]


def _progress(step: int, steps: int) -> None:
    sys.stderr.write(f"\rstep {step}/{steps}")
    sys.stderr.flush()


def _body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": " ".join(args.prompt), "n": args.n, "size": args.size, "seed": args.seed,
                            "steps": args.steps, "guidance_scale": args.guidance_scale,
                            "negative_prompt": args.negative_prompt, "scheduler": args.scheduler,
                            "output_format": args.format}
    return {k: v for k, v in body.items() if v is not None}


def _sse(daemon: Daemon, body: dict) -> Iterator[dict]:
    with daemon.http.stream("POST", "/v1/images/generations", json=body) as resp:
        if resp.status_code >= 400:
            resp.read()
            raise CLIError(error_message(resp))
        for line in resp.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                event = json.loads(line[5:])
                if "error" in event:
                    raise CLIError(event["error"].get("message", str(event["error"])))
                yield event


def _through_daemon(daemon: Daemon, args: argparse.Namespace) -> list[tuple[bytes, int]]:
    out = []
    for event in _sse(daemon, {"model": args.model, "stream": True, **_body(args)}):
        if event.get("type") == "image_generation.progress":
            _progress(event["step"], event["total_steps"])
        elif event.get("type") == "image_generation.completed":
            out.append((base64.b64decode(event["b64_json"]), int(event["seed"])))
    return out


def _in_process(args: argparse.Namespace) -> list[tuple[bytes, int]]:
    from runlm.image_generation.request import ImageRequestError, parse_request
    from runlm.store import ModelNotFoundError, ModelStore

    try:
        req = parse_request(_body(args))  # before the pipeline loads: a typo costs nothing
    except ImageRequestError as exc:
        raise CLIError(str(exc), code=2) from None
    try:
        store = ModelStore()
        path = store.model_path(store.ensure(args.model))
    except (ModelNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    if importlib.util.find_spec("diffusers") is None:
        raise CLIError("diffusers is not installed; run: runlm install-backend diffusers")
    from runlm.image_generation.pipeline import ImageGenerator

    generator = ImageGenerator.load(path)
    try:
        req = generator.resolve(req)
    except ImageRequestError as exc:
        raise CLIError(str(exc), code=2) from None
    return [(img.data, img.seed) for img in generator.generate(req, _progress)]


def cmd_generate_image(args: argparse.Namespace) -> int:
    daemon = connect()
    images = _through_daemon(daemon, args) if daemon else _in_process(args)
    sys.stderr.write("\n")
    for path, (data, seed) in zip(_outputs(args.output, len(images)), images):
        path.write_bytes(data)
        print(f"{path} (seed {seed})")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate-image", help="generate images with a diffusers pipeline model",
                       description="Generate images from PROMPT with an image-generation model (a diffusers "
                                   "pipeline in the store) and write them as files.")
    p.add_argument("model", help="a stored diffusers pipeline (runlm pull ./pipeline-dir)")
    p.add_argument("prompt", nargs="+", help="what to draw; several words are joined with spaces")
    p.add_argument("-o", "--output", default="image.png", help="file to write (with -n: name-1.png, name-2.png, ...)")
    p.add_argument("-n", type=int, default=1, help="how many images (default 1)")
    p.add_argument("--size", default=None, help="WIDTHxHEIGHT, multiples of 8 (default: the model's own size)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the pipeline's)")
    p.add_argument("--seed", type=int, default=None, help="the same seed gives the same image (default: random)")
    p.add_argument("--guidance-scale", type=float, default=None)
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--scheduler", default=None, help="a scheduler the pipeline is compatible with, e.g. EulerDiscrete")
    p.add_argument("--format", default=None, choices=("png", "jpeg", "webp"), help="file format (default png)")
    p.set_defaults(func=cmd_generate_image)
