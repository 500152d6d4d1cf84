"""The project's one way to write a file: into a temporary file beside the target, fsync, rename.

Every writer (checkpoints, analysis reports, prediction files, caches, downloads, built
datasets) goes through :func:`write_atomically` or :func:`atomic_path`, so an interrupted or
failed write never leaves a truncated file where a finished one is expected, and a full or
read-only disk is one line that names the file, says what was kept and how to fix it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Callable, Iterator

#: What every refusal of a damaged or edited checkpoint entry tells the user to do (here, below
#: every package that refuses one: the data states' checks and tasks.checkpoint_fit).
CHECKPOINT_FIX = ("it is damaged or was edited; use another checkpoint of the run (last.ckpt or best-*.ckpt) or retrain "
                  "with python -m app fit")

#: Write errors that mean "this disk or directory cannot take the file" rather than a bug.
DISK_ERRORS = {errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}


class FileWriteError(OSError, ValueError):
    """A file could not be written (disk full, file too large, read-only): an ``OSError`` for
    callers that handle I/O, and a ``ValueError`` so the CLI prints it as one line."""


class RefusedInput(ValueError):
    """A file or setting the user gave on the command line or in a config (not a checkpoint) was
    refused, in one line that names it: readers of a checkpoint pass it on unchanged instead of
    blaming the checkpoint."""


def format_bytes(count: int) -> str:
    """``812 B``, ``33.9 KiB``, ``1.2 GiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def current_umask() -> int:
    """The process's file-creation mask (reading it means setting it, so it is put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_output_file(path: str | os.PathLike | None, option: str, setting: str | None = None) -> None:
    """Raise one ``ValueError`` line, before any work, when the file ``path`` cannot be written:
    it names an existing directory (a result file can only be written over a file), or its
    directory cannot be created (a file stands where a directory would be: ``README.md/out.txt``)
    or takes no files (``/proc/x/out.txt``, a read-only or foreign directory). Nothing is
    created: the nearest existing directory is probed with a temporary file removed at once.
    ``None`` passes. ``setting`` is where the fix goes (default ``--{option}``)."""
    if path is None:
        return
    text = os.fspath(path)
    fix = f"set {setting or '--' + option}"
    if os.path.isdir(text):
        raise ValueError(f"{option} {text} is a directory: name a file to write, e.g. {os.path.join(text, 'out')} ({fix})")
    existing = Path(os.path.abspath(text)).parent
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"{option} {text} cannot be written: {existing} is a file, not a directory; "
            f"{fix} to a file in a directory that exists or can be created"
        )
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ValueError(
            f"{option} {text} cannot be written: cannot create files in {existing} ({error.strerror}); "
            f"{fix} to a file in a writable directory"
        ) from None


def _remove(path: str | None) -> None:
    if path is None or not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.unlink(path)


def _fsync_files(directory: str) -> None:
    """Flush every regular file below ``directory`` to disk (before the directory is renamed)."""
    for parent, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(parent, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())


def _disk_error(error: OSError, path: str, what: str, fix: str, needed: int | None) -> FileWriteError:
    size = f" (about {format_bytes(needed)} to write)" if needed else ""
    kept = f"the previous {path} is kept" if os.path.exists(path) else "nothing was written"
    failure = FileWriteError(f"cannot write {what} {path}: {os.strerror(error.errno)}{size}; {kept}; {fix}")
    failure.errno = error.errno
    return failure


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike, what: str = "file", fix: str = "free space or choose another directory",
    needed: int | None = None, directory: bool = False,
) -> Iterator[Path]:
    """A temporary path beside ``path`` to be filled by the ``with`` body (by a library that wants a
    file name: ``torch.save``, sentencepiece, an archive extractor), renamed over ``path`` when the
    body finishes; removed whatever else happens. ``directory=True`` yields an (empty) directory.

    A full, too small or read-only disk raises :class:`FileWriteError` (one line); any other
    error propagates unchanged. The rename replaces a file; a directory target must not exist
    (another process that finished the same directory first makes the rename fail with an
    ``OSError``: the caller decides whether that copy will do)."""
    target = os.path.abspath(os.fspath(path))
    if not directory and os.path.isdir(target):
        raise FileWriteError(f"cannot write {what} {target}: it is a directory; name a file instead")
    tmp = None
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        prefix, suffix = ".tmp-", "-" + os.path.basename(target)
        if directory:
            tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=prefix, suffix=suffix)
        else:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=prefix, suffix=suffix)
            os.close(fd)
        yield Path(tmp)
        if not directory:
            with open(tmp, "rb") as handle:
                # The rename must not reach the disk before the data it points to.
                os.fsync(handle.fileno())
            # mkstemp creates the file private (0600); give it the mode an ordinary open() would.
            os.chmod(tmp, 0o666 & ~current_umask())
        else:
            _fsync_files(tmp)
            os.chmod(tmp, 0o777 & ~current_umask())
        os.replace(tmp, target)
        tmp = None
    except OSError as error:
        _remove(tmp)
        if error.errno not in DISK_ERRORS:
            raise
        raise _disk_error(error, target, what, fix, needed) from None
    except BaseException as error:
        _remove(tmp)
        refused = error.__context__
        # A library writing through the handle can fail again while closing after the disk refused
        # a write (torch's zip writer: RuntimeError "unexpected pos" at its end record after ENOSPC).
        if isinstance(refused, OSError) and refused.errno in DISK_ERRORS:
            raise _disk_error(refused, target, what, fix, needed) from None
        raise


def write_atomically(
    path: str | os.PathLike, data: str | bytes | Callable[[IO[bytes]], None], what: str = "file",
    fix: str = "free space or choose another directory", needed: int | None = None,
) -> None:
    """Write ``data`` (text is UTF-8 encoded; a callable is given the open binary handle) to
    ``path`` through :func:`atomic_path`."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if isinstance(data, bytes) and needed is None:
        needed = len(data)
    with atomic_path(path, what, fix, needed) as tmp:
        with open(tmp, "wb") as handle:
            if callable(data):
                data(handle)
            else:
                handle.write(data)


def read_cache(path: str | os.PathLike, what: str) -> object | None:
    """What the project cached at ``path`` with ``torch.save`` (weights only: tensors, lists,
    strings), or ``None`` when the file is damaged (cut short, overwritten, not a torch file): a
    cache is rebuilt, never trusted or fatal. One warning names the file."""
    import logging
    import pickle
    import zipfile

    import torch

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        reason = " ".join(str(error).split())[:120]
        logging.getLogger(__name__).warning("%s %s is damaged (%s); it is rebuilt", what, path, reason)
        return None
