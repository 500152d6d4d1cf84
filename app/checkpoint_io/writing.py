"""The one writer of checkpoint files: :class:`AtomicCheckpointIO`.

Lightning's ``TorchCheckpointIO`` serialises into memory and writes through an fsspec transaction,
which for local paths puts the bytes in a temporary file of the *system* temporary directory and
then ``shutil.move``s it onto the checkpoint. That is a rename only when the system temporary
directory and the checkpoint directory share a file system; when they do not (``/tmp`` on tmpfs,
checkpoints on a network or scratch file system, as on most clusters) the move copies the bytes
into the final path, truncating the previous checkpoint first, so a kill in that window leaves
neither the old ``last.ckpt`` nor the new one. Nothing is fsynced either. This plugin writes to a
temporary file in the checkpoint's own directory, fsyncs it and renames it over the final path with
``os.replace`` (atomic within one file system, which the choice of directory guarantees), so the
path always holds either the complete old checkpoint or the complete new one. A state dict with
NaN/Inf weights is refused before anything is written, and a full or read-only disk is one line
that says the previous file is kept (the temporary file is removed). Its ``load_checkpoint`` is
:func:`~app.checkpoint_io.reading.read_checkpoint`.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from app.checkpoint_io.reading import read_checkpoint
from datamodules.files import FileWriteError, write_atomically

#: A file could not be written (disk full, file too large, read-only); one line at the CLI.
CheckpointWriteError = FileWriteError


def non_finite_entries(state_dict: dict[str, Any]) -> tuple[int, str | None]:
    """``(number of non-finite values, name of the first tensor holding one)`` in ``state_dict``."""
    count, first = 0, None
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() or isinstance(value, torch.Tensor) and value.is_complex():
            bad = int((~torch.isfinite(value.detach())).sum())
            if bad:
                count += bad
                first = first or name
    return count, first


def payload_bytes(value: Any) -> int:
    """Bytes of tensor data inside ``value`` (what a checkpoint needs on disk, roughly)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(payload_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value)
    return 0


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose ``save_checkpoint`` is finite-check + write-to-temporary +
    fsync + rename, and whose ``load_checkpoint`` is :func:`read_checkpoint` (weights only).

    Remote paths (``s3://`` ...) are handed to Lightning's own writer, whose object stores
    replace objects atomically anyway.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint takes no storage_options, got {storage_options!r} "
                f"(pass a custom CheckpointIO plugin to use them)"
            )
        count, first = non_finite_entries(checkpoint.get("state_dict") or {})
        if count:
            # The last line of defence behind the tasks' loss guard (e.g. an exploding LR schedule
            # can make weights non-finite while the loss of the step was still finite).
            kept = "the previous checkpoint is kept" if os.path.exists(str(path).removeprefix("file://")) else "nothing was written"
            raise FloatingPointError(
                f"refusing to write checkpoint {path}: its state_dict holds {count} non-finite value(s), first in "
                f"{first}; {kept} (if training diverged, lower the learning rate or set trainer.gradient_clip_val and "
                f"resume from the last good checkpoint; if it was converted, check the input checkpoint)"
            )
        if "://" in str(path) and not str(path).startswith("file://"):
            return super().save_checkpoint(checkpoint, path)
        path = os.path.abspath(str(path).removeprefix("file://"))
        write_atomically(
            path, lambda handle: torch.save(checkpoint, handle), "checkpoint",
            "free space or set --checkpoint.dirpath", payload_bytes(checkpoint),
        )

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if weights_only is False:
            raise ValueError(
                f"{type(self).__name__} reads checkpoints with weights_only=True only (a checkpoint must not run code), "
                f"got weights_only=False for {path}"
            )
        return read_checkpoint(path, "cpu" if map_location is None else map_location)


def in_memory(checkpoint: dict[str, Any]) -> io.BytesIO:
    """``checkpoint`` serialised into a buffer, as it would be on disk."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return buffer
