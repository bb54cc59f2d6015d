"""Weights read into the page cache ahead of the first step.

The runners map a model's files and read each page when a kernel first touches it: load takes a second,
but a cold file's first prompt then waits on the disk page by page, one layer after the other. So once a
runner has the model, the kernel is asked to read the mappings in (madvise WILLNEED, on the mappings the
loader made: no second open) on a thread of its own, while the server answers its first requests; never for
files that would not fit comfortably in the memory available, which reading ahead would only evict again.
"""
from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Iterable

import numpy as np

log = logging.getLogger(__name__)

SHARE_OF_AVAILABLE = 0.5  # read ahead only what fits in this share of MemAvailable


def available_memory() -> int | None:
    """MemAvailable in bytes (Linux), or None where it is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def mapping_of(array: np.ndarray) -> mmap.mmap | None:
    """The file mapping under a numpy view (np.memmap keeps it as ``_mmap``), or None."""
    base: object = array
    while base is not None:
        found = getattr(base, "_mmap", None)
        if isinstance(found, mmap.mmap):
            return found
        base = getattr(base, "base", None)
    return None


def read_ahead(arrays: Iterable[np.ndarray]) -> threading.Thread | None:
    """Start reading the file mappings under ``arrays`` into the page cache on a daemon thread (returned), or
    None where there is none, the platform cannot advise, or they would take more than SHARE_OF_AVAILABLE of
    the memory available."""
    maps = [m for m in (mapping_of(a) for a in arrays) if m is not None]
    available = available_memory()
    if not maps or available is None or not hasattr(mmap, "MADV_WILLNEED"):
        return None
    size = sum(len(m) for m in maps)
    if size > SHARE_OF_AVAILABLE * available:
        log.info("not reading %.1f GB of weights ahead: %.1f GB of memory available", size / 1e9, available / 1e9)
        return None

    def run() -> None:
        for m in maps:
            try:
                m.madvise(mmap.MADV_WILLNEED)
            except (OSError, ValueError) as exc:  # a best effort (a closed mapping too): kernels read pages anyway
                log.debug("read-ahead: %s", exc)

    thread = threading.Thread(target=run, name="runlm-read-ahead", daemon=True)
    thread.start()
    return thread
