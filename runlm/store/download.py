"""Resumable, digest-checked HTTP(S) downloads into the store's partial folder."""
from __future__ import annotations

import hashlib
from pathlib import Path

from runlm.store.blobs import CHUNK, BlobDigestError
from runlm.store.progress import ProgressCallback, PullProgress


class DownloadError(RuntimeError):
    """The server refused, or the transfer broke off (the partial file stays for a resume)."""


def download(url: str, partial: Path, expected: str | None, progress: ProgressCallback | None) -> str:
    """Fetch ``url`` into ``partial`` (resuming from the bytes already there); returns its sha256 digest.

    On a digest mismatch the partial file is deleted (resuming it could never succeed); on a
    broken transfer it is kept, so the next pull asks only for the rest with an HTTP Range.
    """
    import httpx

    partial.parent.mkdir(parents=True, exist_ok=True)
    have = partial.stat().st_size if partial.exists() else 0
    h = hashlib.sha256()
    if have:
        with open(partial, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    headers = {"Range": f"bytes={have}-"} if have else {}
    status = f"pulling {url.rsplit('/', 1)[-1][:40]}"
    try:
        with httpx.stream("GET", url, headers=headers, follow_redirects=True, timeout=60.0) as resp:
            if resp.status_code == 416 and have:  # we already have every byte
                total = have
            elif resp.status_code in (200, 206):
                if resp.status_code == 200 and have:  # the server ignored the Range: start over
                    have, h = 0, hashlib.sha256()
                length = resp.headers.get("content-length")
                total = have + int(length) if length is not None else 0
                done = have
                with open(partial, "ab" if have else "wb") as f:
                    for chunk in resp.iter_bytes():  # as received: a break keeps every byte so far
                        f.write(chunk)
                        h.update(chunk)
                        done += len(chunk)
                        if progress:
                            progress(PullProgress(status, expected, total or done, done))
                if total and done != total:
                    raise DownloadError(f"{url}: got {done} of {total} bytes; run the pull again to resume")
            else:
                raise DownloadError(f"{url}: the server answered HTTP {resp.status_code}")
    except httpx.HTTPError as exc:
        got = partial.stat().st_size if partial.exists() else 0
        raise DownloadError(f"{url}: transfer failed after {got} bytes ({type(exc).__name__}: {exc}); "
                            f"run the pull again to resume") from exc
    digest = "sha256:" + h.hexdigest()
    if expected and digest != expected:
        partial.unlink(missing_ok=True)
        raise BlobDigestError(f"{url}: sha256 of the downloaded bytes is {digest}, expected {expected}")
    return digest
