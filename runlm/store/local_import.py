"""A local import for a daemon started with --allow-local-import DIR, from one handle per file (issue 33).

Checking a path and then opening it again lets a file be swapped for a link out of DIR in between. Here
each file is opened once, walking down from a handle on DIR with O_NOFOLLOW, so no path is looked up
twice; a link inside the model folder is followed only by that one open, and the opened file must then be
under DIR. The model's headers are read through the open handles (``/proc/self/fd``: the same open files,
never the paths again), and the blobs are hashed and copied from the same handles. Nothing is read from a
file before its check, and no error repeats a byte of one.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from runlm.store.sources import SourceError

_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: opening a FIFO must not hang


@dataclass(slots=True, frozen=True)
class OpenedFile:
    rel: str    # its path in the model ("model.gguf" for a one-file model)
    fd: int
    size: int
    projector: bool = False  # the multimodal projector (mmproj GGUF) found beside a one-file model
    shard: bool = False      # one of a split GGUF model's files, kept under its own name


def _real_path(fd: int) -> Path:
    return Path(os.readlink(f"/proc/self/fd/{fd}"))


def _open_dir(parent: int, name: str, shown: str) -> int:
    try:
        return os.open(name, _FLAGS | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SourceError(f"{shown}: not a folder (a symbolic link, or it changed during the import)") from None
        raise SourceError(f"{shown}: cannot be opened ({exc.strerror})") from None


def _open_file(parent: int, name: str, shown: str, root: Path) -> int | None:
    """The file ``name`` in the folder ``parent``, opened once; None for a link to a folder (skipped, as a
    folder walk skips them). A link is followed by this open only, and the file it opened must be under root."""
    try:
        fd = os.open(name, _FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise SourceError(f"{shown}: cannot be opened ({exc.strerror})") from None
        try:  # a symbolic link: allowed while what it opens stays under the folder
            fd = os.open(name, _FLAGS, dir_fd=parent)
        except OSError as exc2:
            raise SourceError(f"{shown}: a symbolic link that cannot be opened ({exc2.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not _real_path(fd).is_relative_to(root):
            raise SourceError(f"{shown}: a symbolic link that leaves the folder local imports are allowed from")
        if stat.S_ISDIR(mode):
            os.close(fd)
            return None
        if not stat.S_ISREG(mode):
            raise SourceError(f"{shown}: not a regular file")
        return fd
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def _shard_names(fd: int, name: str) -> list[str]:
    """A split GGUF model's file names when the open file ``name`` is its first (read through the handle); [] else."""
    from runlm.formats.gguf_header import read_header, shard_paths

    if not name.endswith(".gguf"):
        return []
    try:
        _, metadata, _ = read_header(f"/proc/self/fd/{fd}")
    except (OSError, ValueError, IndexError, KeyError):
        return []  # (inspecting the model says what is wrong with it)
    count = metadata.get("split.count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        return []
    try:
        return [p.name for p in shard_paths(Path(name), count)]
    except ValueError as exc:
        raise SourceError(f"{name}: {exc}") from None


def _walk(dir_fd: int, prefix: str, root: Path, out: list[OpenedFile]) -> None:
    for entry in sorted(os.scandir(dir_fd), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue  # hidden files and folders are not part of a model (as in the path walk)
        rel = f"{prefix}{entry.name}"
        if entry.is_dir(follow_symlinks=False):
            sub = _open_dir(dir_fd, entry.name, rel)
            try:
                _walk(sub, rel + "/", root, out)
            finally:
                os.close(sub)
            continue
        fd = _open_file(dir_fd, entry.name, rel, root)
        if fd is not None:
            out.append(OpenedFile(rel, fd, os.fstat(fd).st_size))


def _projector_beside(dir_fd: int, model_name: str, root: Path) -> OpenedFile | None:
    """llama.cpp's mmproj GGUF beside a one-file model, opened once under the same checks as the model; its
    header is read through the open handle. None when there is none (or it is no projector)."""
    from runlm.store.mmproj import choose_projector, is_projector_file

    names = [e.name for e in os.scandir(dir_fd) if not e.name.startswith(".")]
    chosen = choose_projector(model_name, names)
    if chosen is None:
        return None
    try:
        fd = _open_file(dir_fd, chosen, chosen, root)
    except SourceError:
        return None  # a projector that may not be read is left out, as if it were not there
    if fd is None:
        return None
    if not is_projector_file(f"/proc/self/fd/{fd}"):
        os.close(fd)
        return None
    return OpenedFile(chosen, fd, os.fstat(fd).st_size, projector=True)


@contextlib.contextmanager
def open_model(root: Path, location: Path, single_name: str) -> Iterator[tuple[list[OpenedFile], Path]]:
    """Every file of the model at ``location`` (a file or a folder under ``root``), each opened once, and a
    temporary folder of links to the open files through which ``inspect_model`` reads them (the second
    item: the model's path in that folder). Every handle is closed on the way out."""
    try:
        rel = location.relative_to(root)
    except ValueError:
        raise SourceError(f"{location}: not under the folder local imports are allowed from") from None
    opened: list[OpenedFile] = []
    fds: list[int] = []
    view = Path(tempfile.mkdtemp(prefix="runlm-import-"))
    try:
        fd = os.open(root, _FLAGS | os.O_DIRECTORY)
        fds.append(fd)
        parts = rel.parts
        for i, part in enumerate(parts[:-1]):
            fd = _open_dir(fd, part, "/".join(parts[:i + 1]))
            fds.append(fd)
        if not parts:
            raise SourceError(f"{location}: the allowed folder itself is not a model")
        last = parts[-1]
        try:
            is_dir = stat.S_ISDIR(os.stat(last, dir_fd=fd, follow_symlinks=False).st_mode)
        except OSError as exc:
            raise SourceError(f"{rel}: cannot be opened ({exc.strerror})") from None
        if is_dir:
            top = _open_dir(fd, last, str(rel))
            fds.append(top)
            _walk(top, "", root, opened)
            model = view / last
        else:
            file_fd = _open_file(fd, last, str(rel), root)
            if file_fd is None:
                raise SourceError(f"{rel}: not a file")
            shards = _shard_names(file_fd, last)
            opened.append(OpenedFile(last if shards else single_name, file_fd, os.fstat(file_fd).st_size,
                                     shard=bool(shards)))
            for name in shards[1:]:  # a split model's other files, beside its first, under the same checks
                shard_fd = _open_file(fd, name, str(rel.parent / name), root)
                if shard_fd is None:
                    raise SourceError(f"{rel.parent / name}: not a file")
                opened.append(OpenedFile(name, shard_fd, os.fstat(shard_fd).st_size, shard=True))
            model = view / last
            projector = _projector_beside(fd, last, root)
            if projector is not None:
                opened.append(projector)
        for f in opened:
            link = view / f.rel if f.projector or f.shard else (model / f.rel) if is_dir else model
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(f"/proc/self/fd/{f.fd}")
        yield opened, model
    finally:
        for f in opened:
            with contextlib.suppress(OSError):
                os.close(f.fd)
        for d in fds:
            with contextlib.suppress(OSError):
                os.close(d)
        import shutil

        shutil.rmtree(view, ignore_errors=True)
