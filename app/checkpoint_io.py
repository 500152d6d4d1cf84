"""Checkpoint writing that a kill cannot corrupt, on any local file system.

Lightning's ``TorchCheckpointIO`` serialises into memory and writes through an fsspec
transaction, which for local paths puts the bytes in a temporary file of the *system* temporary
directory and then ``shutil.move``s it onto the checkpoint. That is a rename only when the system
temporary directory and the checkpoint directory share a file system; when they do not (``/tmp``
on tmpfs, checkpoints on a network or scratch file system, as on most clusters) the move copies the
bytes into the final path, truncating the previous checkpoint first, so a kill in that window
(SIGKILL from a scheduler, an out-of-memory kill) leaves neither the old ``last.ckpt`` nor the new
one. Nothing is fsynced either. This plugin writes to a temporary file in the checkpoint's own
directory, fsyncs it and renames it over the final path with ``os.replace`` (atomic within one
file system, which the choice of directory guarantees), so the path always holds either the
complete old checkpoint or the complete new one; it also streams ``torch.save`` to the file
instead of holding a second in-memory copy.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose ``save_checkpoint`` is write-to-temporary + fsync + rename.

    Remote paths (``s3://`` ...) are handed to Lightning's own writer, whose object stores
    replace objects atomically anyway.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint takes no storage_options, got {storage_options!r} "
                f"(pass a custom CheckpointIO plugin to use them)"
            )
        if "://" in str(path) and not str(path).startswith("file://"):
            return super().save_checkpoint(checkpoint, path)
        path = os.path.abspath(str(path).removeprefix("file://"))
        directory = os.path.dirname(path)
        get_filesystem(directory).makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix="-" + os.path.basename(path))
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                # The rename must not reach the disk before the data it points to.
                os.fsync(handle.fileno())
            # mkstemp creates the file private (0600); give it the mode an ordinary open() would.
            os.chmod(tmp, 0o666 & ~current_umask())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def current_umask() -> int:
    """The process's file-creation mask (reading it means setting it, so it is put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
