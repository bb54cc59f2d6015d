"""Arguments more than one subcommand takes."""
from __future__ import annotations

import argparse
from typing import Any


def add_numerics_arguments(p: argparse.ArgumentParser) -> None:
    """--exact-numerics and --threads, the same on `run` and `serve-engine`."""
    p.add_argument("--exact-numerics", action="store_true",
                   help="reference numerics: dequantized weights times fp32 activations (slower; the mode parity "
                        "with transformers is proven in). Default: GGUF blocks as stored, 8-bit activations")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the kernels (default: physical cores)")


def add_serving_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """API keys and TLS, the same on `serve` and `serve-engine`."""
    import os

    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on {what}; repeat it (or separate keys with commas) "
                        "for several (default: $RUNLM_API_KEY; none: no key needed)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read more keys from FILE, one per line ('#' comments allowed), as llama-server's")
    p.add_argument("--ssl-keyfile", default=os.environ.get("RUNLM_SSL_KEYFILE"), metavar="FILE",
                   help="serve HTTPS with this PEM private key (with --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=os.environ.get("RUNLM_SSL_CERTFILE"), metavar="FILE",
                   help="serve HTTPS with this PEM certificate chain (with --ssl-keyfile)")


def serving_keys_and_tls(args: argparse.Namespace) -> tuple[tuple[str, ...], dict[str, Any]]:
    """(the API keys, uvicorn's TLS settings); a ValueError names what is wrong."""
    import os
    from pathlib import Path

    from runlm.web.api_key import read_api_keys

    keys = read_api_keys(args.api_key, args.api_key_file, os.environ.get("RUNLM_API_KEY"))
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    tls: dict[str, Any] = {}
    if args.ssl_keyfile:
        for flag, value in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
            if not Path(value).expanduser().is_file():
                raise ValueError(f"{flag} {value}: no such file")
        tls = {"ssl_keyfile": str(Path(args.ssl_keyfile).expanduser()),
               "ssl_certfile": str(Path(args.ssl_certfile).expanduser())}
    return keys, tls
