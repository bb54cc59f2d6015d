"""package, push and pull: runlm's store on one side, a registry on the other.

Pulls verify every blob's sha256 (the manifest's digest when it was asked for by digest) and resume a
broken blob from its partial file; pushes skip blobs the registry has, mount those another of the model's
repositories on the same registry has, and upload the rest whole or in chunks. The manifest goes last,
so a registry never lists a model whose blobs are missing; locally the ref is written last, as for any pull.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from runlm.store.blobs import BlobDigestError
from runlm.store.download import discard, download
from runlm.store.inspect import inspect_model
from runlm.store.metadata import ModelInfo
from runlm.store.names import ModelName
from runlm.store.oci import artifact, media
from runlm.store.oci.artifact import ArtifactError, Layer
from runlm.store.oci.client import RegistryClient, RegistryError, ReplyTooLarge, read_capped
from runlm.store.oci.credentials import lookup
from runlm.store.oci.reference import Reference, parse_reference
from runlm.store.progress import ProgressCallback, PullProgress
from runlm.store.refs import RefStore, StoredModel, model_manifest


def _short(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


def client_for(store: RefStore, ref: Reference, insecure: bool, chunk_size: int | None = None) -> RegistryClient:
    creds = lookup(ref.registry, store.home)
    kwargs = {"chunk_size": chunk_size} if chunk_size else {}
    return RegistryClient(ref.registry, creds, insecure=insecure,
                          idle_timeout=store.download_limits.idle_seconds, **kwargs)


# --- package ---------------------------------------------------------------------------------------

def with_oci(store: RefStore, manifest: dict, context_size: int | None = None) -> dict:
    """``manifest`` with an OCI artifact (Model Runner's config and manifest, stored as blobs) attached."""
    created = artifact.now()
    layers = artifact.model_layers(manifest["files"], created)
    info = ModelInfo.from_json(manifest["info"])
    gguf_meta = None
    if manifest["layout"] == "file":
        from runlm.formats.gguf_header import read_header
        _, metadata, _ = read_header(store.blobs.path(manifest["files"][0]["digest"]))
        gguf_meta = artifact.gguf_metadata_strings(metadata)
    context = context_size or (manifest.get("oci") or {}).get("context_size")
    config = artifact.config_blob(info, layers, created, context, gguf_meta)
    config_digest, config_size = store.blobs.put_bytes(config)
    config_type = media.DMR_CONFIG_V01 if manifest["layout"] == "file" else media.DMR_CONFIG_V02
    body = artifact.manifest_blob(config_type, config_digest, config_size, layers)
    digest, size = store.blobs.put_bytes(body)
    oci = {"manifest": digest, "size": size, "media_type": media.OCI_MANIFEST, "config": config_digest,
           **({"context_size": context} if context else {})}
    return {**manifest, "oci": oci}


def package(store: RefStore, path: Path, name: str, licenses: tuple[Path, ...] = (), context_size: int | None = None,
            progress: ProgressCallback | None = None, mmproj: Path | None = None) -> StoredModel:
    """Store a GGUF file or a model folder under ``name`` as an OCI artifact Model Runner can read; ``mmproj``
    (llama.cpp's projector GGUF, else one found beside the GGUF file) becomes its ``vnd.docker.ai.mmproj``
    layer, as ``docker model package --mmproj`` writes it."""
    if context_size is not None and context_size <= 0:
        raise ValueError("--context-size must be a positive number of tokens")
    for lic in licenses:
        if not lic.is_file():
            raise ValueError(f"license file {lic} does not exist")
    model = store.pull(str(path), name, progress=progress, mmproj=mmproj)
    with store.adding():
        files = list(model.manifest["files"])
        taken = {f["path"] for f in files}
        for lic in licenses:
            digest, size = store.blobs.put_file(lic)
            rel = artifact.unique_path(artifact.safe_path(lic.name), taken)
            files.append({"path": rel, "digest": digest, "size": size, "media_type": media.DMR_LICENSE})
        manifest = model_manifest(files, model.manifest["layout"], model.info, model.manifest["source"])
        return store.write_ref(model.name, with_oci(store, manifest, context_size))


# --- push ------------------------------------------------------------------------------------------

def push(store: RefStore, name: str, target: str | None = None, insecure: bool = False,
         progress: ProgressCallback | None = None, chunk_size: int | None = None) -> tuple[Reference, str]:
    """Push a stored model; returns the reference and the manifest digest the registry holds."""
    report = progress or (lambda p: None)
    model = store.get(name)
    known = (model.manifest.get("oci") or {}).get("reference")
    if target is None and known is None:
        raise ValueError(f"{model.name} came from no registry: say where to push it (runlm push {model.name.name} "
                         f"REGISTRY/REPOSITORY:TAG)")
    ref = parse_reference(str(target or known))
    if ref.digest:
        raise ValueError(f"{ref}: push to a tag, not a digest")
    with store.adding():
        has_oci = bool((model.manifest.get("oci") or {}).get("manifest"))
        manifest = model.manifest if has_oci else with_oci(store, model.manifest)
        oci = manifest["oci"]
        body = store.blobs.path(oci["manifest"]).read_bytes()
        descriptor = json.loads(body)
        blobs = [descriptor["config"], *descriptor["layers"]]
        mount_from = _mount_source(known, ref)
        with client_for(store, ref, insecure, chunk_size) as client:
            for blob in blobs:
                _push_blob(store, client, ref, blob, mount_from, report)
            report(PullProgress("pushing manifest"))
            remote = client.put_manifest(ref, body, descriptor.get("mediaType", media.OCI_MANIFEST))
        if remote and remote != oci["manifest"]:
            raise RegistryError(f"{ref}: the registry stored the manifest as {remote}, not {oci['manifest']}")
        manifest = {**manifest, "oci": {**oci, "reference": str(ref)}}
        store.write_ref(model.name, manifest)
    report(PullProgress("success"))
    return ref, oci["manifest"]


def push_reference(store: RefStore, reference: str, insecure: bool = False,
                   progress: ProgressCallback | None = None) -> tuple[Reference, str]:
    """Ollama's push: the model named by its registry reference (the one pulled from or pushed to it, else the
    stored ``repository:tag``) goes to that reference."""
    ref = parse_reference(reference)
    for model in store.list():
        if (model.manifest.get("oci") or {}).get("reference") == str(ref):
            return push(store, str(model.name), str(ref), insecure, progress)
    return push(store, str(default_name(ref)), str(ref), insecure, progress)


def _mount_source(known: str | None, ref: Reference) -> str | None:
    """A repository on the same registry that has the model's blobs: the one it was pulled from or pushed to."""
    if not known:
        return None
    with contextlib.suppress(ValueError):
        src = parse_reference(known)
        if src.registry == ref.registry and src.repository != ref.repository:
            return src.repository
    return None


def _push_blob(store: RefStore, client: RegistryClient, ref: Reference, blob: dict, mount_from: str | None,
               report: ProgressCallback) -> None:
    digest, size = blob["digest"], int(blob["size"])
    status = f"pushing {_short(digest)}"
    if client.has_blob(ref, digest, push=True):
        report(PullProgress(status, digest, size, size))
        return
    if mount_from and client.mount(ref, digest, mount_from):
        report(PullProgress(status, digest, size, size))
        return
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        report(PullProgress(status, digest, size, min(done, size)))

    report(PullProgress(status, digest, size, 0))
    client.upload(ref, digest, store.blobs.path(digest), size, on_bytes)


# --- pull ------------------------------------------------------------------------------------------

def default_name(ref: Reference) -> ModelName:
    """The store name for a reference: its repository and tag, without the registry (``runlm ls`` shows it)."""
    return ModelName.parse(f"{ref.repository}:{ref.tag or _short(ref.digest or '')}")


def pull(store: RefStore, reference: str, name: str | None = None, insecure: bool = False,
         progress: ProgressCallback | None = None) -> StoredModel:
    report = progress or (lambda p: None)
    ref = parse_reference(reference)
    target = ModelName.parse(name) if name else default_name(ref)
    report(PullProgress("pulling manifest"))
    with client_for(store, ref, insecure) as client:
        got = client.get_manifest(ref)
        try:
            manifest = json.loads(got.body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RegistryError(f"{ref}: the manifest is not JSON") from None
        mtype = got.media_type if got.media_type in media.MANIFEST_TYPES else manifest.get("mediaType", "")
        if mtype in (media.OCI_INDEX, media.DOCKER_MANIFEST_LIST) or "manifests" in manifest:
            raise ArtifactError(f"{ref} is an index of several artifacts (platforms); pull one of them by digest")
        plan = artifact.plan(manifest)
        config = manifest.get("config") or {}
        with store._lock("pull-oci-" + got.digest[7:31]), store.adding():
            blobs = [Layer("config", str(config.get("digest")), int(config.get("size", 0)), "config"), *plan.layers]
            for layer in blobs:
                _pull_blob(store, client, ref, layer, report)
            report(PullProgress("verifying sha256 digest"))
            context = _context_size(store, config)
            info = _inspect(store, plan)
            files = [{"path": la.path, "digest": la.digest, "size": la.size, "media_type": la.media_type}
                     for la in plan.layers]
            mdigest, msize = store.blobs.put_bytes(got.body)
            oci = {"manifest": mdigest, "size": msize, "media_type": mtype or media.OCI_MANIFEST,
                   "config": config.get("digest"), "reference": str(ref),
                   "kind": plan.kind, **({"context_size": context} if context else {})}
            source = {"kind": "oci", "location": str(ref), "identity": f"oci:{ref}@{mdigest}"}
            report(PullProgress("writing manifest"))
            model = store.write_ref(target, model_manifest(files, plan.layout, info, source, oci=oci))
    report(PullProgress("success"))
    return model


def inspect_remote(store: RefStore, reference: str, insecure: bool = False) -> dict:
    """The registry's manifest and config for ``reference``, and what runlm would store; no layer is fetched."""
    ref = parse_reference(reference)
    with client_for(store, ref, insecure) as client:
        got = client.get_manifest(ref)
        manifest = json.loads(got.body)
        out = {"reference": str(ref), "digest": got.digest, "mediaType": got.media_type, "manifest": manifest}
        config = manifest.get("config") or {}
        size = config.get("size")
        if config.get("digest") and isinstance(size, int) and 0 < size <= 1 << 20:
            resp = client.request("GET", client.blob_url(ref, config["digest"]), client.scope(ref))
            try:  # read at its declared size, no more
                body = read_capped(resp, size) if resp.status_code == 200 else b""
            except ReplyTooLarge:
                body = b""
            finally:
                resp.close()
            if body and "sha256:" + hashlib.sha256(body).hexdigest() == config["digest"]:
                with contextlib.suppress(ValueError):
                    out["config"] = json.loads(body)
    with contextlib.suppress(ArtifactError):
        plan = artifact.plan(manifest)
        out["files"] = [{"path": la.path, "digest": la.digest, "size": la.size} for la in plan.layers]
        out["kind"] = plan.kind
    return out


def _pull_blob(store: RefStore, client: RegistryClient, ref: Reference, layer: Layer,
               report: ProgressCallback) -> None:
    status = f"pulling {_short(layer.digest)}"
    if store.blobs.has(layer.digest):
        report(PullProgress(status, layer.digest, layer.size, layer.size))
        return
    if not client.has_blob(ref, layer.digest):  # also meets the auth challenge before the download starts
        raise RegistryError(f"{ref}: the registry has no blob {layer.digest} although the manifest lists it")
    partial = store.partial / f"{layer.digest.replace(':', '-')}.partial"
    store._drop_stale_partials()
    try:
        digest = download(client.blob_url(ref, layer.digest), partial, layer.digest, report,
                          store.download_limits, headers=client.auth_headers(ref), status=status, size=layer.size)
    except BlobDigestError as exc:
        raise BlobDigestError(f"{ref}: refused a blob whose bytes do not match its digest, nothing stored "
                              f"(the registry's copy is damaged or was tampered with): {exc}") from None
    got = partial.stat().st_size
    if got != layer.size:
        discard(partial)
        raise RegistryError(f"{ref}: blob {layer.digest} has {got} bytes, the manifest says {layer.size}")
    store.blobs.adopt(partial, digest)


def _context_size(store: RefStore, config: dict) -> int | None:
    """Model Runner's config may set the context size the model is meant to run with."""
    digest = config.get("digest")
    if not digest or config.get("mediaType") not in (media.DMR_CONFIG_V01, media.DMR_CONFIG_V02):
        return None
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        value = json.loads(store.blobs.path(digest).read_bytes()).get("config", {}).get("context_size")
        return int(value) if value else None
    return None


def _inspect(store: RefStore, plan: artifact.Plan) -> ModelInfo:
    """Read the model's headers from its blobs (a folder of links for a folder model, and for a split GGUF model's
    shards, which are found by their names)."""
    shards = sum(1 for la in plan.layers if la.media_type == media.DMR_GGUF)
    if plan.layout == "file" and shards <= 1:
        return inspect_model(store.blobs.path(plan.layers[0].digest))
    with _linked_folder(store, plan.layers) as folder:
        return inspect_model(folder / plan.layers[0].path if plan.layout == "file" else folder)


@contextlib.contextmanager
def _linked_folder(store: RefStore, layers: list[Layer]) -> Iterator[Path]:
    (store.home / "tmp").mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=store.home / "tmp", prefix="oci-"))
    try:
        for la in layers:
            link = folder / la.path
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(store.blobs.path(la.digest))
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
