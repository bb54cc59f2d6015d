"""Weights read into the page cache ahead of the first step.

The runners map a model's files and read each page when a kernel first touches it: load takes a second,
but a cold file's first prompt then waits on the disk page by page, one layer after the other. So once a
runner has the model, the kernel is asked to read the mappings in (madvise WILLNEED on the mappings the
loader made, no second open; llama.cpp advises its own mapping so at load) on a thread of its own, while
the server answers its first requests; never for files that would not fit comfortably in the memory
available, which reading ahead would only evict again.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from collections.abc import Callable, Iterable

import numpy as np

from runlm.sizes import available_memory

log = logging.getLogger(__name__)

SHARE_OF_AVAILABLE = 0.5  # read ahead only what fits in this share of MemAvailable


def mapping_of(array: np.ndarray) -> tuple[int, int] | None:
    """(address, length) of the file mapping under a numpy view (np.memmap's array sits on the mmap object), or
    None where there is none."""
    view: object = array
    while isinstance(view, np.ndarray):
        if isinstance(view.base, mmap.mmap):
            return view.ctypes.data, len(view.base)
        view = view.base
    return None


def _madvise(advice: int | None = getattr(mmap, "MADV_WILLNEED", None)) -> Callable[[int, int], int] | None:
    """libc's madvise(address, length, advice) through ctypes, which lets go of the GIL for the call
    (mmap.madvise holds it while the kernel queues the reads: the loading thread would wait on the disk)."""
    if advice is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return lambda address, length: fn(address, length, advice)


def drop_mapped_pages(arrays: Iterable[np.ndarray]) -> None:
    """Let go of this process's pages of the file mappings under ``arrays`` (views of a model file that nothing
    reads again: a weight the native library holds repacked). MADV_DONTNEED on a read-only file mapping only
    unmaps: the page cache keeps the pages, and a later read maps them again from it. Arrays on anything but a
    file mapping are left alone (there it would zero them)."""
    spans = [(a.ctypes.data, a.nbytes) for a in arrays if mapping_of(a) is not None and not a.flags.writeable]
    advise = _madvise(getattr(mmap, "MADV_DONTNEED", None)) if spans else None
    if advise is None:
        return
    page = mmap.PAGESIZE
    for address, length in spans:  # whole pages inside the array only: its neighbours' bytes stay mapped
        start, end = -(-address // page) * page, (address + length) // page * page
        if end > start and advise(start, end - start) != 0:
            log.debug("madvise(DONTNEED) failed (errno %d)", ctypes.get_errno())


def read_ahead(arrays: Iterable[np.ndarray]) -> threading.Thread | None:
    """Start reading the file mappings under ``arrays`` into the page cache on a daemon thread (returned), or
    None where there is none, the platform cannot advise, or they would take more than SHARE_OF_AVAILABLE of
    the memory available."""
    maps = [m for m in (mapping_of(a) for a in arrays) if m is not None]
    advise = _madvise() if maps else None
    if advise is None:
        return None
    size, available = sum(length for _, length in maps), available_memory()
    if size > SHARE_OF_AVAILABLE * available:
        log.info("not reading %.1f GB of weights ahead: %.1f GB of memory available", size / 1e9, available / 1e9)
        return None

    def run() -> None:
        for address, length in maps:  # a best effort: the kernels read the pages anyway
            if advise(address, length) != 0:
                log.debug("read-ahead: madvise failed (errno %d)", ctypes.get_errno())

    thread = threading.Thread(target=run, name="runlm-read-ahead", daemon=True)
    thread.start()
    return thread
