"""Quantized copies of stored models (``runlm quantize``, Ollama's ``/api/create`` with ``quantize``): the model's
GGUF file written as Q4_K_M, Q8_0... by runlm.quantize, then stored under a name of its own."""
from __future__ import annotations

import tempfile
from pathlib import Path

from runlm.formats import ModelFormatError
from runlm.quantize import QuantizeError, QuantizeReport, quantize_file
from runlm.store.progress import ProgressCallback, PullProgress
from runlm.store.store import ModelStore


def source_file(store: ModelStore, source: str, local_files: bool) -> Path:
    """What to quantize: a GGUF file or a safetensors model folder, as a path (where ``local_files``: the CLI's
    user, not an HTTP client) or the files of the stored model ``source``."""
    path = Path(source).expanduser()
    if local_files and (path.is_file() or (path / "config.json").is_file()):
        return path
    model = store.ensure(source)
    file = store.model_path(model)
    if not (file.is_file() and file.suffix == ".gguf" or model.info.format == "safetensors"):
        raise QuantizeError(f"{source!r} is a {model.info.format} model; runlm quantizes GGUF files (F16, BF16 or F32)"
                            f" and safetensors folders")
    return file


def quantize_with_progress(file: Path, target: Path, type_name: str, imatrix: Path | None = None,
                           threads: int | None = None, progress: ProgressCallback | None = None) -> QuantizeReport:
    """quantize_file, its progress told as pull progress (the CLI's bar, Ollama's NDJSON lines). A safetensors
    folder is written as a GGUF file first (runlm/quantize/convert.py), beside the target, then quantized."""
    report = progress or (lambda p: None)
    if file.is_dir():
        from runlm.quantize.convert import convert_folder

        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
            converted = Path(tmp) / f"{file.name}.gguf"
            status = f"converting {file.name} to GGUF"
            try:
                convert_folder(file, converted, "auto", lambda done, total: report(PullProgress(status, None, total,
                                                                                                 done)))
            except ModelFormatError as exc:
                raise QuantizeError(str(exc)) from None
            return quantize_with_progress(converted, target, type_name, imatrix, threads, progress)
    status = f"quantizing {file.name} to {type_name.upper()}"
    return quantize_file(file, target, type_name, imatrix, threads,
                         lambda done, total: report(PullProgress(status, None, total, done)))


def quantize_into_store(store: ModelStore, file: Path, name: str, type_name: str, imatrix: Path | None = None,
                        threads: int | None = None, progress: ProgressCallback | None = None
                        ) -> tuple[QuantizeReport, str]:
    """``file`` quantized and stored as ``name``; (the report, the stored name)."""
    store.blobs.tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=store.blobs.tmp, prefix="quantize-") as tmp:
        out = Path(tmp) / f"{Path(name.replace(':', '-')).name}.gguf"
        result = quantize_with_progress(file, out, type_name, imatrix, threads, progress)
        model = store.pull(str(out), name, progress=progress)
    return result, str(model.name)
