"""Content-addressed blobs: each file is stored once, under the sha256 of its bytes."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
CHUNK = 1 << 20
BLOB_MODE = 0o400  # read-only, and for the store's owner alone: a model may be private


class BlobDigestError(ValueError):
    """Downloaded bytes whose sha256 is not the one expected."""


def check_digest(digest: str) -> str:
    if not _DIGEST.fullmatch(digest):
        raise ValueError(f"not a sha256 digest: {digest!r} (expected 'sha256:' and 64 hex digits)")
    return digest


def file_digest(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    return "sha256:" + h.hexdigest()


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root.parent / "tmp"

    def path(self, digest: str) -> Path:
        return self.root / check_digest(digest).replace(":", "-")

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def digests(self) -> set[str]:
        if not self.root.is_dir():
            return set()
        names = (p.name.replace("-", ":", 1) for p in self.root.iterdir())
        return {n for n in names if _DIGEST.fullmatch(n)}

    def put_file(self, src: Path, on_bytes: Callable[[int], None] | None = None) -> tuple[str, int]:
        """Copy ``src`` in, hashing as it goes; returns (digest, size). A blob that exists is not copied twice."""
        with open(src, "rb") as fin:
            return self.put_open_file(fin, on_bytes)

    def put_open_file(self, fin: BinaryIO, on_bytes: Callable[[int], None] | None = None) -> tuple[str, int]:
        """``put_file`` from a file already open (read from where it stands to its end)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
        h = hashlib.sha256()
        fd, tmp_name = tempfile.mkstemp(dir=self.tmp, prefix="blob-")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as fout:
                while chunk := fin.read(CHUNK):
                    h.update(chunk)
                    fout.write(chunk)
                    if on_bytes:
                        on_bytes(len(chunk))
            digest = "sha256:" + h.hexdigest()
            return digest, self.adopt(tmp, digest)
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, data: bytes) -> tuple[str, int]:
        """Store a small blob held in memory (an OCI config or manifest); returns (digest, size)."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if not self.has(digest):
            self.tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(dir=self.tmp, prefix="blob-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            self.adopt(Path(tmp_name), digest)
        return digest, len(data)

    def adopt(self, tmp: Path, digest: str) -> int:
        """Move a fully written, verified temp file into place (atomic rename; no-op if present)."""
        target = self.path(digest)
        size = tmp.stat().st_size
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if target.exists():
            tmp.unlink()
        else:
            os.chmod(tmp, BLOB_MODE)
            os.replace(tmp, target)
        return size

    def remove(self, digest: str) -> int:
        path = self.path(digest)
        size = path.stat().st_size if path.exists() else 0
        path.unlink(missing_ok=True)
        return size

    def total_size(self) -> int:
        return sum(p.stat().st_size for p in self.root.iterdir()) if self.root.is_dir() else 0

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
