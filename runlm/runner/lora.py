"""LoRA adapters for models the daemon serves: ``runlm configure MODEL --lora NAME=PATH``.

The CLI copies an adapter's files into the store's blobs (as ``pull`` imports local files: the daemon
never reads a path a client names) and configures the model with ``{"loras": {NAME: {file: digest}}}``,
per adapter the shape of Ollama's ``/api/create`` ``adapters``. The daemon then hard-links those blobs
into a directory of the adapter's own under ``$RUNLM_HOME/adapters`` (links outlive a garbage collection
of the blobs), and the native backend serves them (``serve-engine --enable-lora --lora-modules``).
A request whose ``model`` is NAME goes to the base model's backend with NAME kept, which selects it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from runlm.runner.config import PEFT_FILES, ConfigError, parse_loras
from runlm.store.blobs import BlobStore

__all__ = ["PEFT_FILES", "import_adapter", "materialize", "parse_loras"]

def import_adapter(blobs: BlobStore, path: Path) -> dict[str, str]:
    """A PEFT directory or a GGUF LoRA file -> {file name: digest}, its files now blobs of the store."""
    if path.is_dir():
        missing = [f for f in PEFT_FILES if not (path / f).is_file()]
        if missing:
            raise ConfigError(f"{path}: not a PEFT adapter directory (no {', '.join(missing)})")
        files = [path / f for f in PEFT_FILES]
    elif path.is_file() and path.suffix == ".gguf":
        files = [path]
    else:
        raise ConfigError(f"{path}: a LoRA adapter is a PEFT directory or a .gguf file")
    return {f.name: blobs.put_file(f)[0] for f in files}


def materialize(home: Path, blobs: BlobStore, files: dict[str, str]) -> Path:
    """The adapter as a normal file layout (a PEFT directory, or the .gguf file) of hard links to its blobs."""
    for digest in files.values():
        if not blobs.has(digest):
            raise ConfigError(f"adapter blob {digest} is not in the store (runlm configure --lora imports it)")
    key = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:24]
    target = home / "adapters" / key
    if not target.is_dir():
        tmp = home / "tmp" / f"adapter-{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for file, digest in files.items():
            try:
                os.link(blobs.path(digest), tmp / file)
            except OSError:  # another filesystem: a copy
                shutil.copyfile(blobs.path(digest), tmp / file)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(tmp, target)
        except OSError:  # made by another process first
            shutil.rmtree(tmp, ignore_errors=True)
    gguf = [f for f in files if f.endswith(".gguf")]
    return target / gguf[0] if gguf else target
