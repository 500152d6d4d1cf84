"""The one reader of checkpoint files: :func:`read_checkpoint`.

``torch.load(..., weights_only=False)`` runs whatever a pickle asks for, so a checkpoint file could
run a shell command the moment it is opened. Every checkpoint the project reads
(``fit/validate/test/predict --ckpt_path`` through :class:`~app.checkpoint_io.writing.AtomicCheckpointIO`,
the CLI's hyper-parameter merge, ``analyze``, ``convert``, ``bench``) goes through
:func:`read_checkpoint`, which unpickles with ``weights_only=True``: tensors, numbers, strings and
containers only (PyTorch's own allow-list; project checkpoints need nothing more). The class paths a
checkpoint names (task, datamodule, head, encoder) are imported only when they name a class of the
expected kind inside the project's packages (:mod:`app.checkpoint_io.classes`), and the runtime
options a file may carry are dropped (:mod:`app.checkpoint_io.policy`). A missing, empty,
truncated or foreign file is one ``ValueError`` line naming the file.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
import warnings
import zipfile
from typing import IO, Any

import numpy as np
import numpy._core.multiarray as np_multiarray
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH

from app.checkpoint_io.classes import check_class_paths, check_hyper_parameters, drop_runtime_options
from app.checkpoint_io.structure import check_structure

#: What a checkpoint may hold beyond PyTorch's own weights-only set (tensors, numbers, strings,
#: containers): plain numpy arrays and scalars, as in random-number-generator states that data
#: loaders save. Their reconstruction calls no code of the file's choosing. Object, void and
#: string dtypes are left out: numbers only.
SAFE_GLOBALS = [np.ndarray, np.dtype, np_multiarray._reconstruct, np_multiarray.scalar] + [
    getattr(np.dtypes, name) for name in dir(np.dtypes)
    if name.endswith("DType") and name not in ("ObjectDType", "VoidDType", "StringDType", "StrDType", "BytesDType")
]

ZIP_MAGIC = b"PK\x03\x04"
LEGACY_MAGIC = b"\x80\x02\x8a\x0a"


#: Checkpoints read once and kept for the next read of the same unchanged local file (see
#: :func:`read_checkpoint`'s ``hand_over``), keyed by (path, size, mtime, map_location).
HANDED_OVER: dict[tuple[str, int, int, str], dict[str, Any]] = {}


def read_checkpoint(source: _PATH | IO[bytes], map_location: Any = "cpu", hand_over: bool = False) -> dict[str, Any]:
    """The checkpoint dictionary in ``source`` (a path, ``file://`` / remote URL or a binary file
    object), unpickled with ``weights_only=True``; every class path it names is checked with
    :func:`check_class_paths`. Raises one ``ValueError`` line naming the file when it is missing,
    empty, damaged, not a checkpoint, or asks to import anything.

    ``hand_over``: keep the dictionary for the next read of the same unchanged file, which takes
    it instead of reading the file again. The CLI reads ``--ckpt_path`` for the model it builds
    and hands the dictionary over to the Trainer's restore: one read (one CRC scan, one unpickling)
    per command."""
    key = handover_key(source, map_location)
    if key is not None and key in HANDED_OVER:
        return HANDED_OVER.pop(key)
    checkpoint = _read(source, map_location)
    if hand_over and key is not None:
        HANDED_OVER.clear()
        HANDED_OVER[key] = checkpoint
    return checkpoint


def handover_key(source: Any, map_location: Any) -> tuple[str, int, int, str] | None:
    """What identifies one version of a local checkpoint file, or ``None`` (not a local path, or
    a device mapping that is not a plain string)."""
    if not isinstance(source, (str, os.PathLike)) or not isinstance(map_location, str):
        return None
    path = os.fspath(source).removeprefix("file://")
    if "://" in path:
        return None
    try:
        status = os.stat(path)
    except OSError:
        return None
    return os.path.realpath(path), status.st_size, status.st_mtime_ns, map_location


def _read(source: _PATH | IO[bytes], map_location: Any) -> dict[str, Any]:
    where = source if isinstance(source, (str, os.PathLike)) else getattr(source, "name", "<in-memory checkpoint>")
    where = os.fspath(where) if isinstance(where, os.PathLike) else str(where)
    local = isinstance(source, (str, os.PathLike)) and ("://" not in where or where.startswith("file://"))
    if local:
        path = where.removeprefix("file://")
        if not os.path.exists(path):
            raise ValueError(f"checkpoint {where} does not exist: pass the path of a .ckpt file written by python -m app fit")
        if os.path.isdir(path):
            raise ValueError(f"checkpoint {where} is a directory: pass the path of a .ckpt file inside it (e.g. last.ckpt)")
        if not os.path.isfile(path):
            raise ValueError(
                f"checkpoint {where} is not a regular file (a device, pipe or socket): pass the path of a .ckpt file written "
                f"by python -m app fit"
            )
        if os.path.getsize(path) == 0:
            raise ValueError(
                f"checkpoint {where} is empty (0 bytes): it was never completely written; use another checkpoint of the run "
                f"(last.ckpt or best-*.ckpt)"
            )
        try:
            with open(path, "rb") as handle:
                head = handle.read(4)
        except OSError as error:
            raise ValueError(f"checkpoint {where} cannot be read ({error.strerror}): check the path and its permissions") from None
        # torch.save writes a zip archive; files of torch < 1.6 start with a protocol-2 pickle of a magic number
        if not (head.startswith(ZIP_MAGIC) or head.startswith(LEGACY_MAGIC)):
            raise ValueError(
                f"checkpoint {where} is not a PyTorch checkpoint (it starts with bytes {head.hex(' ')}, not a zip archive "
                f"written by torch.save): pass a .ckpt file written by python -m app fit"
            )
        if head.startswith(ZIP_MAGIC):
            check_archive(path, where)
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(SAFE_GLOBALS):
            # "Detected pickle protocol 4": a plain pickle, refused below anyway
            warnings.simplefilter("ignore", UserWarning)
            if local:
                with open(where.removeprefix("file://"), "rb") as handle:
                    checkpoint = torch.load(handle, map_location=map_location, weights_only=True)
            elif isinstance(source, (str, os.PathLike)):
                with get_filesystem(where).open(where, "rb") as handle:
                    checkpoint = torch.load(handle, map_location=map_location, weights_only=True)
            else:
                checkpoint = torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" not in str(error):
            raise ValueError(damaged(where, error)) from None
        raise ValueError(
            f"checkpoint {where} was refused: it {unsafe_request(error)}, and a checkpoint may hold only tensors, numbers, "
            f"strings and containers (it was not written by python -m app; do not open it with weights_only=False)"
        ) from None
    except Exception as error:  # noqa: BLE001 - a damaged archive fails anywhere in the unpickler (struct.error, ...)
        if isinstance(error, FileNotFoundError | PermissionError):
            raise ValueError(f"checkpoint {where} cannot be read ({error.strerror}): check the path and its permissions") from None
        raise ValueError(damaged(where, error)) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        found = sorted(map(str, checkpoint))[:6] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(
            f"checkpoint {where} is not a training checkpoint: expected a dictionary with a state_dict, found {found} "
            f"(pass a .ckpt file written by python -m app fit)"
        )
    check_structure(checkpoint, where)
    check_class_paths(checkpoint, where)
    checkpoint = drop_runtime_options(checkpoint, where)
    check_hyper_parameters(checkpoint, where)
    return checkpoint


def unsafe_request(error: pickle.UnpicklingError) -> str:
    """What a file refused by ``weights_only`` asked for (``asks to import posix.system``)."""
    wanted = re.search(r"GLOBAL ([\w.]+)", str(error)) or re.search(r"but got <class '([\w.]+)'>", str(error))
    operand = re.search(r"Unsupported operand (\d+)", str(error))
    return (f"asks to import {wanted.group(1)}" if wanted else
            f"uses pickle operation {operand.group(1)}" if operand else "holds objects other than data")


def read_tensor_file(path: str, option: str) -> Any:
    """What a ``torch.save`` file the user gives with ``option`` holds (``analyze rank
    --log_probs``), unpickled with ``weights_only=True`` as :func:`read_checkpoint` does; every way
    the file cannot be read (missing, not a regular file, cut short, another format, a pickle
    that asks to import code) is one ``ValueError`` line naming it."""
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.exists(path) else "is not a regular file"
        raise ValueError(f"{option} {path} {what}: pass a file written by torch.save")
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(SAFE_GLOBALS):
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" in str(error):
            raise ValueError(
                f"{option} {path} was refused: it {unsafe_request(error)}, and it may hold only tensors, numbers, strings and "
                f"containers (do not open it with weights_only=False)"
            ) from None
        reason = error
    except Exception as error:  # noqa: BLE001 - any failure to parse a foreign file is the file's, said in one line
        reason = error
    text = " ".join(str(reason).split())
    text = text[:120] + ("…" if len(text) > 120 else "")
    raise ValueError(
        f"{option} {path} cannot be read as a torch.save file ({type(reason).__name__}: {text}): pass a file written by torch.save"
    )


def check_archive(path: str, where: str) -> None:
    """Refuse a zip checkpoint that is cut short or whose bytes changed: torch.load checks neither
    (a flipped byte in a tensor record loads as a silently different weight), the zip's CRC-32 of
    every record does. Reads the file once more, at disk speed."""
    try:
        with zipfile.ZipFile(path) as archive:
            unstored = unstored_record(archive, os.path.getsize(path))
            bad = archive.testzip() if unstored is None else None
            order = next((archive.read(name) for name in archive.namelist() if name.endswith("/byteorder")), None)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as error:
        if not zipfile.is_zipfile(path):
            raise ValueError(
                f"checkpoint {where} is cut short ({os.path.getsize(path)} bytes, its zip archive has no end record): the "
                f"write was interrupted or the copy is incomplete; re-copy it or use another checkpoint of the run"
            ) from None
        raise ValueError(damaged(where, error)) from None
    if unstored is not None:
        raise ValueError(
            f"checkpoint {where} has a record {unstored.filename[:80]!r} that is compressed or larger than the file "
            f"({unstored.compress_size} bytes stored, {unstored.file_size} claimed), and torch.save stores every record as it "
            f"is: the file was edited or written by another program; use a checkpoint written by python -m app fit"
        )
    if bad is not None:
        raise ValueError(
            f"checkpoint {where} is damaged: the checksum of its record {bad} does not match (bytes changed on disk or in "
            f"transfer); re-copy it or use another checkpoint of the run"
        )
    # torch.load byte-swaps every tensor of a file whose byteorder record names the other order:
    # an edited record would turn every weight into other, mostly finite, numbers.
    if order is not None and order != sys.byteorder.encode():
        raise ValueError(
            f"checkpoint {where} says its tensors are stored {order[:16].decode(errors='replace')!r}-endian, but this machine "
            f"and every checkpoint written here are {sys.byteorder}-endian: the file was edited or written elsewhere; use a "
            f"checkpoint written by python -m app fit"
        )


def unstored_record(archive: zipfile.ZipFile, size: int) -> zipfile.ZipInfo | None:
    """The first record of ``archive`` (a file of ``size`` bytes) that is compressed or makes the
    records larger than the file, or ``None``: torch.save stores every record as it is, and the
    checksum scan inflates whatever a record claims (100 GB of zeros compress to 100 MB and would
    keep every reader busy for minutes)."""
    total = 0
    for info in archive.infolist():
        total += info.file_size
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size or total > size:
            return info
    return None


def damaged(where: str, error: BaseException) -> str:
    """The line for a checkpoint whose archive cannot be read (cut short, bytes changed)."""
    reason = " ".join(str(error).split())
    reason = reason[:120] + ("…" if len(reason) > 120 else "")
    return (
        f"checkpoint {where} is damaged ({type(error).__name__}: {reason}): the file is cut short or its bytes changed; "
        f"re-copy it or use another checkpoint of the run"
    )
