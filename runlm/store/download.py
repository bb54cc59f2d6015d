"""Resumable, digest-checked, bounded HTTP(S) downloads into the store's partial folder.

Bounds: a whole download and each silence in it have time limits; redirects are few, never go from
https to http, and carry no Authorization to another origin; a file whose size was declared is cut off
past it (and refused when the Content-Length disagrees), with nothing kept.

A broken transfer keeps its partial file, with the validator (ETag or
Last-Modified) it came with, so the next pull asks only for the rest, and only if the file is
still the same (If-Range; the answer's Content-Range must start where the partial ends). A
refusal, a wrong digest or a full disk deletes the partial file.
"""
from __future__ import annotations

import errno
import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path

from runlm.store.blobs import CHUNK, BlobDigestError
from runlm.store.progress import ProgressCallback, PullProgress


class DownloadError(RuntimeError):
    """The server refused, or the transfer broke off (the partial file stays for a resume)."""


@dataclass(slots=True, frozen=True)
class DownloadLimits:
    total_seconds: float = 6 * 3600.0  # one file, start to end
    idle_seconds: float = 60.0         # no byte for this long: the transfer is broken
    max_redirects: int = 5


def _validator_path(partial: Path) -> Path:
    return partial.with_name(partial.name + ".validator")


def discard(partial: Path) -> None:
    partial.unlink(missing_ok=True)
    _validator_path(partial).unlink(missing_ok=True)


def _origin(url) -> tuple[str, str, int | None]:  # type: ignore[no-untyped-def]
    port = url.port or {"http": 80, "https": 443}.get(url.scheme)
    return url.scheme, url.host, port


def follow_redirect(resp, url: str, headers: dict[str, str]) -> tuple[str, dict[str, str]]:  # type: ignore[no-untyped-def]
    """Where a redirect answer leads, and the headers to send there: never from https to http (or anything
    but http(s)), and no Authorization once scheme, host or port change."""
    target = resp.next_request.url if resp.next_request is not None else None
    if target is None:
        raise DownloadError(f"{url}: a redirect without a Location")
    if target.scheme not in ("http", "https") or (resp.url.scheme == "https" and target.scheme != "https"):
        raise DownloadError(f"{url}: refusing a redirect from {resp.url.scheme} to {target.scheme}")
    if _origin(target) != _origin(resp.url):
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
    return str(target), headers


def _open(client, url: str, headers: dict[str, str], limits: DownloadLimits):  # type: ignore[no-untyped-def]
    """The response to GET url, following at most ``max_redirects`` redirects, never https -> http. An
    Authorization header goes to the first origin only (a registry's redirect to its storage must not carry it)."""
    for _ in range(limits.max_redirects + 1):
        resp = client.send(client.build_request("GET", url, headers=headers), stream=True)
        if not resp.is_redirect:
            return resp
        resp.close()  # its body is never read
        url, headers = follow_redirect(resp, url, headers)
    raise DownloadError(f"{url}: more than {limits.max_redirects} redirects")


def _resume_start(resp, have: int) -> int | None:  # type: ignore[no-untyped-def]
    """Where a 206 answer starts (it must be where the partial file ends), else None."""
    m = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", resp.headers.get("content-range", "").strip())
    return int(m.group(1)) if m else None


def download(url: str, partial: Path, expected: str | None, progress: ProgressCallback | None,
             limits: DownloadLimits = DownloadLimits(), headers: dict[str, str] | None = None,
             status: str | None = None, size: int | None = None) -> str:
    """Fetch ``url`` into ``partial`` (resuming from the bytes already there); returns its sha256 digest.
    ``headers`` go with the request (a registry's Authorization); ``status`` names the transfer in progress.
    ``size``, when the file's size was declared (an OCI descriptor), bounds what is written: a Content-Length
    that disagrees is refused before a byte is written, and a stream running past it is cut off there."""
    import httpx

    partial.parent.mkdir(parents=True, exist_ok=True)
    validator_file = _validator_path(partial)
    validator = validator_file.read_text() if validator_file.exists() else None
    if partial.exists() and validator is None:
        discard(partial)  # bytes of unknown origin: nothing proves the file is still the same
    have = partial.stat().st_size if partial.exists() else 0
    if size is not None and have > size:
        discard(partial)  # more than the whole file: not a start of it
        have = 0
    h = hashlib.sha256()
    if have:
        with open(partial, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    # identity: the bytes counted, hashed and bounded are the bytes sent, never a decompression of them
    headers = {**(headers or {}), "Accept-Encoding": "identity",
               **({"Range": f"bytes={have}-", "If-Range": validator} if have and validator else {})}
    status = status or f"pulling {url.rsplit('/', 1)[-1][:40]}"
    deadline = time.monotonic() + limits.total_seconds
    timeout = httpx.Timeout(30.0, read=limits.idle_seconds)
    try:
        with httpx.Client(timeout=timeout, follow_redirects=False) as client:
            resp = _open(client, url, headers, limits)
            try:
                if resp.status_code == 416 and have:  # we already have every byte
                    return _finish(h, partial, expected, url)
                if resp.status_code == 206 and _resume_start(resp, have) != have:
                    discard(partial)  # the next pull starts over
                    raise DownloadError(f"{url}: the server resumed at the wrong place "
                                        f"(Content-Range {resp.headers.get('content-range')!r}, we have {have} bytes)")
                if resp.status_code not in (200, 206):
                    discard(partial)
                    raise DownloadError(f"{url}: the server answered HTTP {resp.status_code}")
                if resp.status_code == 200:  # a fresh copy: the Range was ignored, or the file changed
                    have, h = 0, hashlib.sha256()
                    new_validator = resp.headers.get("etag") or resp.headers.get("last-modified")
                    if new_validator:
                        validator_file.write_text(new_validator)
                    else:
                        validator_file.unlink(missing_ok=True)
                length = resp.headers.get("content-length")
                total = have + int(length) if length is not None and length.isdigit() else 0
                if size is not None and total and total != size:
                    discard(partial)
                    raise DownloadError(f"{url}: the server announces {total} bytes, but {size} were declared; "
                                        f"nothing was kept")
                limit = size if size is not None else total or None
                done = have
                with open(partial, "ab" if have else "wb") as f:
                    for chunk in resp.iter_raw():  # as received: a break keeps every byte so far
                        if limit is not None and done + len(chunk) > limit:
                            f.close()
                            discard(partial)
                            raise DownloadError(f"{url}: the server sent more than the {limit} bytes "
                                                f"{'declared' if size is not None else 'it announced'}; "
                                                f"nothing was kept")
                        f.write(chunk)
                        h.update(chunk)
                        done += len(chunk)
                        if progress:
                            progress(PullProgress(status, expected, size or total or done, done))
                        if time.monotonic() > deadline:
                            raise DownloadError(f"{url}: the download took longer than {limits.total_seconds:.0f}s; "
                                                f"run the pull again to resume")
                if total and done != total:
                    raise DownloadError(f"{url}: got {done} of {total} bytes; run the pull again to resume")
            finally:
                resp.close()
    except httpx.HTTPError as exc:
        got = partial.stat().st_size if partial.exists() else 0
        raise DownloadError(f"{url}: transfer failed after {got} bytes ({type(exc).__name__}: {exc}); "
                            f"run the pull again to resume") from exc
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # EFBIG: a file-size limit
            discard(partial)
            raise DownloadError(f"{url}: the disk is full ({exc.strerror}); the partial download was deleted "
                                f"and nothing was stored") from None
        raise
    return _finish(h, partial, expected, url)


def _finish(h: hashlib._Hash, partial: Path, expected: str | None, url: str) -> str:
    digest = "sha256:" + h.hexdigest()
    if expected and digest != expected:
        discard(partial)
        raise BlobDigestError(f"{url}: sha256 of the downloaded bytes is {digest}, expected {expected}")
    _validator_path(partial).unlink(missing_ok=True)
    return digest
