"""``runlm quantize IN OUT TYPE``: a GGUF file (or a stored model's) written as Q4_K_M, Q8_0..., as
llama-quantize writes it; OUT a .gguf path, or a name to store the result under."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runlm.cli.client import CLIError
from runlm.store.progress import ProgressBar, human_bytes


def cmd_quantize(args: argparse.Namespace) -> int:
    from runlm.quantize import QuantizeError
    from runlm.quantize.ggml_ops import QuantizerUnavailable
    from runlm.quantize.imatrix import ImatrixError
    from runlm.store import InvalidNameError, ModelNotFoundError, ModelStore
    from runlm.store.quantized import quantize_into_store, quantize_with_progress, source_file

    store = ModelStore()
    bar = ProgressBar(sys.stderr)
    imatrix = Path(args.imatrix).expanduser() if args.imatrix else None
    try:
        file = source_file(store, args.source, local_files=True)
        if args.target.endswith(".gguf"):
            report = quantize_with_progress(file, Path(args.target).expanduser(), args.type, imatrix, args.threads,
                                            bar)
            where = args.target
        else:
            report, where = quantize_into_store(store, file, args.target, args.type, imatrix, args.threads, bar)
    except (QuantizeError, QuantizerUnavailable, ImatrixError, InvalidNameError, ModelNotFoundError, OSError,
            ValueError) as exc:
        raise CLIError(str(exc)) from None
    finally:
        bar.close()
    print(f"{report.type_name}: {human_bytes(report.size_in)} -> {human_bytes(report.size_out)} in "
          f"{report.seconds:.1f}s: {where}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write a GGUF model as Q4_K_M, Q8_0, ... (llama-quantize's types and choices)",
                       description="Quantize an F16, BF16 or F32 GGUF file or a safetensors model folder (a path or "
                                   "a stored model's) with ggml's own quantizers and llama.cpp's per-tensor choices.")
    p.add_argument("source", help="a .gguf file, a safetensors model folder or a stored model's name")
    p.add_argument("target", help="a .gguf path to write, or a name to store the result under")
    p.add_argument("type", help="Q8_0, Q6_K, Q5_K_M, Q5_K_S, Q4_K_M, Q4_K_S, Q5_1, Q5_0, Q4_1, Q4_0, F16, BF16")
    p.add_argument("--imatrix", default=None, metavar="FILE",
                   help="an importance matrix from llama-imatrix (its GGUF or legacy .dat format)")
    p.add_argument("--threads", type=int, default=None, help="threads quantizing side by side (default: every core)")
    p.set_defaults(func=cmd_quantize)
