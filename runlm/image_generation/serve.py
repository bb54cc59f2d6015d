"""``python -m runlm.image_generation.serve PIPELINE_DIR --uds SOCKET``: the diffusers backend's process.

The socket opens first and the pipeline loads behind it (``/health`` answers 503 until then); if
loading fails the process exits with status 1, so the runner sees the failure and its log says why.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from runlm.image_generation.request import MAX_SIDE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="runlm-diffusers", description="Serve one diffusers pipeline over "
                                "OpenAI's images API (POST /v1/images/generations).")
    p.add_argument("model", help="a diffusers pipeline directory (model_index.json)")
    p.add_argument("--uds", required=True, help="the Unix socket to listen on (mode 0600)")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: MODEL)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:N)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="weights' dtype (default float32 on CPU, float16 on a GPU)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--max-waiting", type=int, default=8, help="requests that may wait before new ones get 503")
    p.add_argument("--max-side", type=int, default=MAX_SIDE, help=f"largest width or height (default {MAX_SIDE})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from runlm.image_generation.pipeline import ImageGenerator
    from runlm.image_generation.server import ImageServer, build_app
    from runlm.web.listen import open_socket

    args = parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the pipeline is in the store: nothing to fetch
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        sock, where = open_socket("127.0.0.1", 0, args.uds)
    except OSError as exc:
        print(f"runlm diffusers: {exc}", file=sys.stderr)
        return 1
    state = ImageServer(args.served_model_name or args.model, max_waiting=args.max_waiting, max_side=args.max_side)
    failed: list[BaseException] = []

    def on_load_error(exc: BaseException) -> None:
        failed.append(exc)
        server.should_exit = True

    app = build_app(state, load=lambda: ImageGenerator.load(args.model, args.device, args.dtype),
                    api_key=os.environ.get("RUNLM_API_KEY"), on_load_error=on_load_error)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=False, timeout_graceful_shutdown=5))
    print(f"runlm diffusers: serving {state.model_name!r} on {where}", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        Path(args.uds).unlink(missing_ok=True)
    if failed:
        print(f"runlm diffusers: the pipeline failed to load: {failed[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
