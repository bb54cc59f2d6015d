"""A model's own recommended sampling settings, read from its files: ``generation_config.json`` in a model
directory (what vLLM's ``--generation-config auto`` reads) and the ``general.sampling.*`` keys of a GGUF file
(llama.cpp's). Keys are SamplingParams' field names; a setting the model does not recommend is absent.

Only the reading is here: the server merges these under a request's own fields (runlm/server/sampling.py).
"""
from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runlm.formats import ModelFormatError

# SamplingParams field -> (type, lowest, highest): what a model file may set (values outside are dropped)
FIELDS: dict[str, tuple[type, float, float]] = {
    "temperature": (float, 0.0, 2.0), "top_p": (float, 1e-9, 1.0), "top_k": (int, -1, 1 << 20),
    "min_p": (float, 0.0, 1.0), "repetition_penalty": (float, 1e-9, 10.0),
    "presence_penalty": (float, -2.0, 2.0), "frequency_penalty": (float, -2.0, 2.0),
    "dry_multiplier": (float, 0.0, 100.0), "dry_base": (float, 1.0, 10.0), "dry_allowed_length": (int, 1, 1000),
    "dry_penalty_last_n": (int, -1, 1 << 31), "penalty_last_n": (int, -1, 1 << 31),
    "typical_p": (float, 1e-9, 1.0), "top_n_sigma": (float, -1.0, 100.0), "xtc_probability": (float, 0.0, 1.0),
    "xtc_threshold": (float, 0.0, 1.0), "mirostat": (int, 0, 2), "mirostat_tau": (float, 1e-9, 20.0),
    "mirostat_eta": (float, 1e-9, 1.0),
    "max_tokens": (int, 1, 1 << 31)}
# generation_config.json's names (transformers' GenerationConfig) for the fields vLLM takes from it
_HF_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# llama.cpp's GGUF keys (gguf-py's Keys.General.SAMPLING_*) for the fields runlm's sampler has
_GGUF_NAMES = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
               "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
               "general.sampling.penalty_repeat": "repetition_penalty",
               "general.sampling.penalty_last_n": "penalty_last_n",
               "general.sampling.xtc_probability": "xtc_probability",
               "general.sampling.xtc_threshold": "xtc_threshold", "general.sampling.mirostat": "mirostat",
               "general.sampling.mirostat_tau": "mirostat_tau", "general.sampling.mirostat_eta": "mirostat_eta"}
# Ollama's option names (Modelfile PARAMETER, /api/show "parameters") for the same fields
OLLAMA_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                "frequency_penalty": "frequency_penalty", "num_predict": "max_tokens", "typical_p": "typical_p",
                "repeat_last_n": "penalty_last_n", "mirostat": "mirostat", "mirostat_tau": "mirostat_tau",
                "mirostat_eta": "mirostat_eta"}

# Ollama options runlm has one answer to: accepted at that value, refused at any other (and why)
OLLAMA_FIXED: dict[str, tuple[Any, str]] = {
    "use_mmap": (True, "runlm always maps the model file"),
    "use_mlock": (False, "runlm does not lock model memory"),
    "numa": (False, "runlm has no NUMA mode"),
    "low_vram": (False, "runlm has no low-VRAM mode; use a smaller num_ctx"),
    "vocab_only": (False, "runlm loads whole models"),
    "penalize_newline": (True, "newlines are penalized as any token (Ollama no longer has the option)"),
    "tfs_z": (1.0, "tail-free sampling is gone from llama.cpp; 1.0 (off) is the only value"),
}
MIN_CONTEXT = 16  # the smallest num_ctx runlm loads a model with


def checked(values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> dict[str, float | int]:
    """The recognised, well-typed, in-range settings of ``values`` (renamed through ``names`` when given),
    in FIELDS' order. A model file's odd value is dropped rather than breaking every request."""
    found: dict[str, float | int] = {}
    for key, value in values.items():
        field = names.get(key) if names is not None else key
        if field not in FIELDS or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        kind, low, high = FIELDS[field]
        value = float(value)
        if kind is int and not value.is_integer() or not math.isfinite(value) or not low <= value <= high:
            continue
        found[field] = int(value) if kind is int else round(value, 6)  # GGUF's float32 0.2 reads 0.2
    return {f: found[f] for f in FIELDS if f in found}


def from_generation_config(directory: Path) -> dict[str, float | int]:
    """The settings a model directory's (or any folder's) generation_config.json recommends; {} without one."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: not a readable JSON file ({exc})") from exc
    return checked(config, _HF_NAMES) if isinstance(config, dict) else {}


def from_gguf_metadata(metadata: Mapping[str, Any]) -> dict[str, float | int]:
    return checked({k: v for k, v in metadata.items() if k in _GGUF_NAMES}, _GGUF_NAMES)


def read_sampling_defaults(path: Path) -> dict[str, float | int]:
    """What the model at ``path`` (a .gguf file, or a directory with generation_config.json or one .gguf)
    recommends."""
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not (path / "config.json").exists():
            path = ggufs[0]
        else:
            return from_generation_config(path)
    from runlm.formats.gguf_header import read_header

    try:
        _, metadata, _ = read_header(path)
    except (ValueError, IndexError, KeyError) as exc:
        raise ModelFormatError(f"{path.name}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    return from_gguf_metadata(metadata)


def to_ollama(defaults: Mapping[str, float | int]) -> dict[str, float | int]:
    """Settings in SamplingParams' names as Ollama's options (those Ollama has)."""
    names = {field: name for name, field in OLLAMA_NAMES.items()}
    return {names[f]: v for f, v in defaults.items() if f in names}


def ollama_parameters(parameters: Mapping[str, Any]) -> str:
    """Ollama's /api/show ``parameters`` text: one ``name value`` line per value (a list, as stop, one per item)."""
    return "\n".join(f"{name:<30} {json.dumps(v) if isinstance(v, str) else v}" for name, value in parameters.items()
                     for v in (value if isinstance(value, list) else [value]))
