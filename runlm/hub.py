"""Hugging Face repos by id (``org/name``, ``hf.co/org/name:Q4_K_M``): which of a repo's files make the model, fetched
through huggingface_hub into its cache (or found there when the hub cannot be reached). Beside runlm.catalog: the
engine's factory resolves a repo id to a path through it, and the store pulls repos with it."""
from __future__ import annotations

import re
from pathlib import Path

from runlm.formats.gguf_header import SHARD_NAME
from runlm.formats.projector_names import choose_projector, looks_like_projector

_HF_REPO = re.compile(r"(?:hf\.co/|huggingface\.co/)?([A-Za-z0-9][\w.-]*/[\w.-]+)(?::([\w.-]+))?")
HF_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*/config.json"]
# a diffusers pipeline: the index, each component's configs, tokenizer files and plain weights; not the
# repo's single-file checkpoints nor its fp16 / non-EMA variants, which would double or triple the download
DIFFUSERS_PATTERNS = ["model_index.json", "*/*.json", "*/*.txt", "*/*.model", "*/diffusion_pytorch_model.safetensors",
                      "*/diffusion_pytorch_model-*.safetensors", "*/model.safetensors", "*/model-*.safetensors"]


def _cache_dir() -> str | None:
    """The Hugging Face cache as the environment names it now (huggingface_hub reads it once, when imported)."""
    import os

    hf_home = os.environ.get("HF_HOME")
    return os.environ.get("HF_HUB_CACHE") or (os.path.join(hf_home, "hub") if hf_home else None)


class HubError(LookupError):
    """A repo that cannot be had: unknown, unreachable and not cached, or without the file asked for."""


def hub_repo(text: str) -> tuple[str, str | None] | None:
    """(repo, tag) of a Hugging Face repo id (``org/name``, ``hf.co/org/name:Q4_K_M``); None for anything else."""
    m = _HF_REPO.fullmatch(text.strip())
    if m is None or text.startswith((".", "/", "~")):
        return None
    return m.group(1), m.group(2)


def fetch_hf(repo: str, tag: str | None) -> Path:
    """The repo's files from huggingface_hub (its local cache when offline); a .gguf file or a directory."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        files = HfApi().list_repo_files(repo)
        patterns = hf_patterns(files, tag, repo)
        snapshot = Path(snapshot_download(repo, allow_patterns=patterns, cache_dir=_cache_dir()))
    except (OfflineModeIsEnabled, OSError) as exc:
        if not isinstance(exc, OfflineModeIsEnabled) and "offline" not in str(exc).lower() \
                and "connect" not in str(exc).lower():
            raise HubError(f"Hugging Face repo {repo!r}: {exc}") from exc
        try:
            snapshot = Path(snapshot_download(repo, local_files_only=True, cache_dir=_cache_dir()))
        except LocalEntryNotFoundError:
            raise HubError(f"Hugging Face repo {repo!r} is not in the local cache and the hub cannot be "
                              f"reached (offline)") from None
    except Exception as exc:  # RepositoryNotFoundError, GatedRepoError, HTTP errors
        raise HubError(f"Hugging Face repo {repo!r}: {type(exc).__name__}: {exc}") from exc
    ggufs = sorted(p.name for p in snapshot.glob("*.gguf") if not looks_like_projector(p.name))
    if ggufs and not any(snapshot.glob("*.safetensors")):
        return snapshot / _pick_gguf(ggufs, tag, repo)
    return snapshot


def hf_patterns(files: list[str], tag: str | None, repo: str) -> list[str]:
    """Which of a repo's files a pull downloads: one GGUF file, a diffusers pipeline, or a model directory."""
    if "model_index.json" in files:
        return DIFFUSERS_PATTERNS
    ggufs = [f for f in files if f.endswith(".gguf")]
    models = [f for f in ggufs if not looks_like_projector(f.rsplit("/", 1)[-1])]
    if models and not any(f.endswith(".safetensors") for f in files):
        pick = _pick_gguf(models, tag, repo)
        # llama.cpp's vision repos: the projector (mmproj-*.gguf) beside the weights, kept with them
        folder, _, name = pick.rpartition("/")
        beside = [f.rsplit("/", 1)[-1] for f in ggufs if f.rpartition("/")[0] == folder]
        projector = choose_projector(name, beside)
        shards = _shards_of(pick, models)
        return shards + ([f"{folder}/{projector}" if folder else projector] if projector else [])
    return HF_PATTERNS


def _shards_of(pick: str, names: list[str]) -> list[str]:
    """Every file of a split model whose first file is ``pick`` (just ``pick`` for a one-file model)."""
    m = SHARD_NAME.fullmatch(pick)
    if m is None:
        return [pick]
    return sorted(n for n in names if (s := SHARD_NAME.fullmatch(n)) and s["stem"] == m["stem"]
                  and s["count"] == m["count"])


def _pick_gguf(names: list[str], tag: str | None, repo: str) -> str:
    # a split model is its first file (the loader finds the others beside it)
    names = [n for n in names if (s := SHARD_NAME.fullmatch(n)) is None or int(s["no"]) == 1]
    if tag and tag != "latest":
        hits = [n for n in names if tag.lower() in n.lower()]
        if not hits:
            raise HubError(f"{repo} has no GGUF file matching {tag!r} (it has: {', '.join(sorted(names))})")
        return sorted(hits)[0]
    preferred = [n for n in names if "q4_k_m" in n.lower()]
    return (preferred or sorted(names))[0]
