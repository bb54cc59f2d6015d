"""``runlm create NAME -f Modelfile [--quantize TYPE]``: a model made from an Ollama Modelfile, as ``ollama create``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runlm.cli.client import CLIError
from runlm.store.progress import ProgressBar


def cmd_create(args: argparse.Namespace) -> int:
    from runlm.formats.modelfile import MAX_MODELFILE, ModelfileError, parse_modelfile
    from runlm.quantize import QuantizeError
    from runlm.sizes import read_small_text
    from runlm.store import InvalidNameError, ModelNotFoundError, ModelStore
    from runlm.store.modelfile_model import ModelSpecError, create_from_modelfile

    file = Path(args.file).expanduser()
    if file.is_dir():
        file = file / "Modelfile"
    bar = ProgressBar(sys.stderr)
    try:
        modelfile = parse_modelfile(read_small_text(str(file), MAX_MODELFILE, "-f"))
        model = create_from_modelfile(ModelStore(), args.model, modelfile, file.parent, args.quantize, bar)
    except (ModelfileError, ModelSpecError, QuantizeError, InvalidNameError, ModelNotFoundError, OSError,
            ValueError) as exc:
        raise CLIError(str(exc)) from None
    finally:
        bar.close()
    print(f"created {model.name} from {modelfile.base}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("create", help="make a model from a Modelfile (FROM, PARAMETER, TEMPLATE, SYSTEM, MESSAGE, "
                                      "ADAPTER, LICENSE)",
                       description="Make a model from an Ollama Modelfile: its base (FROM a stored model, a GGUF "
                                   "file or a model folder) with the Modelfile's template, system prompt, messages, "
                                   "parameters and LoRA adapter as its defaults wherever it is served.")
    p.add_argument("model", help="the new model's name")
    p.add_argument("-f", "--file", default="Modelfile", help="the Modelfile (default: ./Modelfile)")
    p.add_argument("-q", "--quantize", default=None, metavar="TYPE",
                   help="quantize the base first (GGUF F16/BF16/F32 or safetensors): Q4_K_M, Q8_0... as "
                        "`runlm quantize`")
    p.set_defaults(func=cmd_create)
