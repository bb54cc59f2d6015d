"""Arguments more than one subcommand takes."""
from __future__ import annotations

import argparse


def add_numerics_arguments(p: argparse.ArgumentParser) -> None:
    """--exact-numerics and --threads, the same on `run` and `serve-engine`."""
    p.add_argument("--exact-numerics", action="store_true",
                   help="reference numerics: dequantized weights times fp32 activations (slower; the mode parity "
                        "with transformers is proven in). Default: GGUF blocks as stored, 8-bit activations")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the kernels (default: physical cores)")
