"""ModelStore: the store at $RUNLM_HOME (runlm/store/refs.py) that also pulls from OCI registries.

A registry reference (``host/name:tag``) goes to runlm/store/oci/transfer.py, everything else (a path, a
URL, a built-in name, a Hugging Face repo) to the refs store's own sources.
"""
from __future__ import annotations

from pathlib import Path

from runlm.store.oci.reference import looks_like_reference
from runlm.store.oci.transfer import pull as pull_oci
from runlm.store.progress import ProgressCallback
from runlm.store.refs import (
    ModelNotFoundError,
    NameConflictError,
    RefStore,
    StoredModel,
    default_home,
    model_manifest,
    used_digests,
)
from runlm.store.sources import ANY_LOCAL, LocalAccess

__all__ = ["ModelNotFoundError", "ModelStore", "NameConflictError", "StoredModel", "default_home", "model_manifest",
           "used_digests"]


class ModelStore(RefStore):
    def pull(self, source_text: str, name: str | None = None, progress: ProgressCallback | None = None,
             access: LocalAccess = ANY_LOCAL, insecure: bool = False, mmproj: Path | None = None) -> StoredModel:
        """Store a model from a path, URL, built-in name, HF repo or registry reference (``host/name:tag``; plain
        http only with ``insecure``); concurrent pulls of one source share it. ``access`` says which local
        files may be read (the daemon's HTTP API passes its own)."""
        # decided from the text alone over HTTP (a remote caller must not learn which paths exist); the CLI's
        # user may name a local folder that happens to read like one
        if looks_like_reference(source_text) and not (access.any and Path(source_text).expanduser().exists()):
            if mmproj is not None:
                raise ValueError("--mmproj goes with a local GGUF file; a registry's artifact carries its projector "
                                 "as a layer of its own")
            return pull_oci(self, source_text, name, insecure=insecure, progress=progress)
        return super().pull(source_text, name, progress, access, insecure, mmproj)
