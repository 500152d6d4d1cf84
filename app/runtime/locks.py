"""One run per checkpoint directory: a lock file that names its holder.

Two ``fit`` runs writing into one ``checkpoint.dirpath`` at the same time corrupt each other
without an error: both number their files from the same listing, so ``best-*.ckpt`` and
``last.ckpt`` end up holding the other run's weights. A run therefore holds
``<dirpath>/run.lock`` while it trains. The file says who holds it (pid, host, command, start
time); *holding* it is an exclusive ``flock`` on the open file, which the kernel (or the NFS lock
manager) drops when the process dies however it dies, so the file of a killed run is a stale
lock that the next run simply takes over.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shlex
import socket
import sys
import time
import warnings
from pathlib import Path

LOCK_NAME = "run.lock"

#: Locks this process holds (descriptor, lock file, directories created for it, deepest first),
#: released by ``release_run_locks`` (``app.cli.run_command`` calls it on every exit path).
HELD: list[tuple[int, Path, list[Path]]] = []


def acquire_run_lock(dirpath: str | os.PathLike, command: list[str], option: str = "checkpoint.dirpath") -> Path | None:
    """Take ``<dirpath>/run.lock`` for this process or raise one ``ValueError`` line naming the
    run that holds it. Returns the lock's path (``None`` when the file system has no locks)."""
    directory = Path(dirpath).expanduser().absolute()
    created = [d for d in (directory, *directory.parents) if not d.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ValueError(
                    f"{option} {directory} is in use by another run ({describe_holder(path)}): "
                    f"wait for it to finish or pass another --{option}"
                ) from None
            warnings.warn(f"cannot lock {path} ({error.strerror}): runs sharing this directory are not detected")
            remove_empty(created)
            return None
        # The holder may have released and removed the file between our open() and flock():
        # then we locked an unlinked inode and must retry on the file now at the path.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": shlex.join(["python", "-m", "app", *command])}
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(record) + "\n").encode())
    os.fsync(fd)
    HELD.append((fd, path, created))
    return path


def describe_holder(path: Path) -> str:
    """``pid P on host H, started T: COMMAND`` from a lock file (what could be read of it)."""
    try:
        record = json.loads(path.read_text())
        return f"pid {record['pid']} on host {record['host']}, started {record['started']}: {record['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"holder unknown, see {path}"


def release_run_locks() -> None:
    """Remove the lock files this process holds, then drop the locks (removing first, so that
    no other run can lock the file in between and then lose it), and the directories created
    for them if the run left them empty (it failed before writing a checkpoint)."""
    while HELD:
        fd, path, created = HELD.pop()
        try:
            path.unlink()
        except OSError:
            pass
        os.close(fd)
        remove_empty(created)


def remove_empty(directories: list[Path]) -> None:
    """``rmdir`` each directory, deepest first, up to the first that is not empty."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


#: The temporary file :func:`datamodules.files.atomic_path` writes a checkpoint through:
#: ``.tmp-`` + ``tempfile``'s eight random characters + ``-`` + the checkpoint's file name.
CHECKPOINT_TEMPORARY = re.compile(r"\.tmp-[a-z0-9_]{8}-[^/]+\.ckpt")


def remove_leftover_temporaries(dirpath: str | os.PathLike) -> list[Path]:
    """Delete the temporary files an interrupted checkpoint write left in ``dirpath``
    (:data:`CHECKPOINT_TEMPORARY`, matched exactly: any other file, ``.tmp-notes.txt`` included,
    is the user's). Only safe while holding the directory's run lock: a live run's temporary
    file would look the same."""
    directory = Path(dirpath)
    removed = []
    for path in directory.iterdir() if directory.is_dir() else ():
        if CHECKPOINT_TEMPORARY.fullmatch(path.name) and path.is_file() and not path.is_symlink():
            path.unlink()
            removed.append(path)
    if removed:
        print(f"removed {len(removed)} unfinished checkpoint file(s) of an interrupted run from {directory}",
              file=sys.stderr)
    return removed
