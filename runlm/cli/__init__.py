"""The ``runlm`` command."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from runlm import __version__
from runlm.cli.arguments import add_numerics_arguments


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="answer one prompt, or chat interactively, with a model",
                       description="Stream a model's answer to PROMPT. With no PROMPT: read it from piped "
                                   "stdin, or start an interactive chat on a terminal (/bye or Ctrl-D quits).")
    p.add_argument("model", nargs="?", default=None,
                   help="built-in name (smollm2, tinycoder), a .gguf file or a model directory (default: smollm2)")
    p.add_argument("prompt", nargs="*", help="the prompt; several words are joined with spaces")
    # unset: the model's recommended setting (runlm show lists them), else the value in brackets
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (model's, else 0.7)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (model's, else 0.95)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (model's, else 40)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="longest answer in tokens (model's, else 512)")
    p.add_argument("--system", default=None, help="system message placed before the conversation")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image the model sees with the (first) prompt, for a vision model; repeat it for several")
    p.add_argument("--verbose", action="store_true",
                   help="after each answer, the prompt and answer token counts, durations and rates (Ollama's)")
    p.add_argument("--format", default=None, choices=("json",), help="answer with a JSON object")
    p.add_argument("--think", default=None, nargs="?", const="true", choices=("true", "false"),
                   help="turn a reasoning model's thinking on (or off: --think=false); default: the model's")
    p.add_argument("--hidethinking", action="store_true", help="print the answer without the thinking")
    add_numerics_arguments(p)
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from runlm.cli.run import run_command

    return run_command(args)


def _add_serve_engine(sub: argparse._SubParsersAction) -> None:
    from runlm.cli.serve_engine import add_parser

    add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runlm", description="Run language models locally.")
    parser.add_argument("--version", action="version", version=f"runlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run(sub)
    _add_serve_engine(sub)
    from runlm.cli import bench, create, daemon, generate_image, models, quantize, registry

    models.add_parsers(sub)
    registry.add_parsers(sub)
    daemon.add_parsers(sub)
    generate_image.add_parsers(sub)
    bench.add_parser(sub)
    quantize.add_parser(sub)
    create.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from runlm.cli.client import CLIError

    try:
        return args.func(args)
    except CLIError as exc:
        print(f"runlm {args.command}: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
