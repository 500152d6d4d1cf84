"""Checkpoints are data: the one reader and the one writer of checkpoint files.

Reading (:func:`read_checkpoint`). ``torch.load(..., weights_only=False)`` runs whatever a pickle
asks for, so a checkpoint file could run a shell command the moment it is opened. Every checkpoint
the project reads (``fit/validate/test/predict --ckpt_path`` through :class:`AtomicCheckpointIO`,
the CLI's hyper-parameter merge, ``analyze``, ``convert``, ``bench``) goes through
:func:`read_checkpoint`, which unpickles with ``weights_only=True``: tensors, numbers, strings and
containers only (PyTorch's own allow-list; project checkpoints need nothing more). The class paths a
checkpoint names (task, datamodule, head, encoder) are imported only when they name a class of the
expected kind inside the project's packages (:func:`project_class`). A missing, empty, truncated or
foreign file is one ``ValueError`` line naming the file.

Writing (:meth:`AtomicCheckpointIO.save_checkpoint`). Lightning's ``TorchCheckpointIO``
serialises into memory and writes through an fsspec transaction, which for local paths puts the
bytes in a temporary file of the *system* temporary directory and then ``shutil.move``s it onto
the checkpoint. That is a rename only when the system temporary directory and the checkpoint
directory share a file system; when they do not (``/tmp`` on tmpfs, checkpoints on a network or
scratch file system, as on most clusters) the move copies the bytes into the final path,
truncating the previous checkpoint first, so a kill in that window leaves neither the old
``last.ckpt`` nor the new one. Nothing is fsynced either. This plugin writes to a temporary file in
the checkpoint's own directory, fsyncs it and renames it over the final path with ``os.replace``
(atomic within one file system, which the choice of directory guarantees), so the path always
holds either the complete old checkpoint or the complete new one. A state dict with NaN/Inf
weights is refused before anything is written, and a full or read-only disk is one line that says
the previous file is kept (the temporary file is removed).
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import re
import warnings
import zipfile
from typing import IO, Any

import numpy as np
import numpy._core.multiarray as np_multiarray
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from datamodules.files import FileWriteError, write_atomically

#: What a checkpoint may hold beyond PyTorch's own weights-only set (tensors, numbers, strings,
#: containers): plain numpy arrays and scalars, as in random-number-generator states that data
#: loaders save. Their reconstruction calls no code of the file's choosing. Object, void and
#: string dtypes are left out: numbers only.
SAFE_GLOBALS = [np.ndarray, np.dtype, np_multiarray._reconstruct, np_multiarray.scalar] + [
    getattr(np.dtypes, name) for name in dir(np.dtypes)
    if name.endswith("DType") and name not in ("ObjectDType", "VoidDType", "StringDType", "StrDType", "BytesDType")
]

#: Packages whose classes a checkpoint may name.
PROJECT_PACKAGES = ("tasks", "datamodules", "heads")

#: Lightning's own instantiator, the only one a checkpoint may name (``_instantiator`` key).
TRUSTED_INSTANTIATORS = ("lightning.pytorch.cli.instantiate_module",)

ZIP_MAGIC = b"PK\x03\x04"
LEGACY_MAGIC = b"\x80\x02\x8a\x0a"

#: A file could not be written (disk full, file too large, read-only); one line at the CLI.
CheckpointWriteError = FileWriteError


# ---------------------------------------------------------------------- reading
def read_checkpoint(source: _PATH | IO[bytes], map_location: Any = "cpu") -> dict[str, Any]:
    """The checkpoint dictionary in ``source`` (a path, ``file://`` / remote URL or a binary file
    object), unpickled with ``weights_only=True``; every class path it names is checked with
    :func:`check_class_paths`. Raises one ``ValueError`` line naming the file when it is missing,
    empty, damaged, not a checkpoint, or asks to import anything."""
    where = source if isinstance(source, (str, os.PathLike)) else getattr(source, "name", "<in-memory checkpoint>")
    where = os.fspath(where) if isinstance(where, os.PathLike) else str(where)
    local = isinstance(source, (str, os.PathLike)) and ("://" not in where or where.startswith("file://"))
    if local:
        path = where.removeprefix("file://")
        if not os.path.exists(path):
            raise ValueError(f"checkpoint {where} does not exist: pass the path of a .ckpt file written by python -m app fit")
        if os.path.isdir(path):
            raise ValueError(f"checkpoint {where} is a directory: pass the path of a .ckpt file inside it (e.g. last.ckpt)")
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
        wanted = re.search(r"GLOBAL ([\w.]+)", str(error)) or re.search(r"but got <class '([\w.]+)'>", str(error))
        operand = re.search(r"Unsupported operand (\d+)", str(error))
        what = (f"asks to import {wanted.group(1)}" if wanted else
                f"uses pickle operation {operand.group(1)}" if operand else "holds objects other than data")
        raise ValueError(
            f"checkpoint {where} was refused: it {what}, and a checkpoint may hold only tensors, numbers, strings and "
            f"containers (it was not written by python -m app; do not open it with weights_only=False)"
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile, UnicodeDecodeError, IndexError, KeyError,
            TypeError, AttributeError, MemoryError, OverflowError) as error:
        if isinstance(error, FileNotFoundError | PermissionError):
            raise ValueError(f"checkpoint {where} cannot be read ({error.strerror}): check the path and its permissions") from None
        raise ValueError(damaged(where, error)) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        found = sorted(map(str, checkpoint))[:6] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(
            f"checkpoint {where} is not a training checkpoint: expected a dictionary with a state_dict, found {found} "
            f"(pass a .ckpt file written by python -m app fit)"
        )
    check_class_paths(checkpoint, where)
    checkpoint = upgrade_checkpoint(checkpoint, where)
    check_hyper_parameters(checkpoint, where)
    return checkpoint


def upgrade_checkpoint(checkpoint: dict[str, Any], where: str, task: type | None = None) -> dict[str, Any]:
    """``checkpoint`` in the form its task class reads today.

    A task class whose arguments or parameter names changed keeps older checkpoints loading with a
    classmethod ``upgrade_checkpoint(checkpoint: dict) -> dict`` that rewrites ``hyper_parameters``
    (and ``state_dict``) of the old form into the new one and returns a checkpoint already in the
    new form unchanged (it is applied by every reader: :func:`read_checkpoint`, hence ``--ckpt_path``
    and the CLI's hyper-parameter merge, and :func:`model_from_checkpoint`). The class paths of the
    result are checked like those of the file. ``task`` is the task class when the caller knows it
    (checkpoints that name none); otherwise the one the checkpoint names."""
    import lightning.pytorch as pl

    if task is None:
        class_path = (checkpoint.get("hyper_parameters") or {}).get("_class_path") or (checkpoint.get("headbench") or {}).get("task")
        if not class_path:
            return checkpoint
        task = project_class(class_path, pl.LightningModule, "the model class", where)
    upgrade = getattr(task, "upgrade_checkpoint", None)
    if upgrade is None:
        return checkpoint
    upgraded = upgrade(checkpoint)
    if not isinstance(upgraded, dict) or not isinstance(upgraded.get("state_dict"), dict):
        raise TypeError(f"{task.__qualname__}.upgrade_checkpoint must return the checkpoint dictionary, got {type(upgraded).__name__}")
    if upgraded is not checkpoint:
        check_class_paths(upgraded, where)
    return upgraded


def check_archive(path: str, where: str) -> None:
    """Refuse a zip checkpoint that is cut short or whose bytes changed: torch.load checks neither
    (a flipped byte in a tensor record loads as a silently different weight), the zip's CRC-32 of
    every record does. Reads the file once more, at disk speed."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as error:
        if not zipfile.is_zipfile(path):
            raise ValueError(
                f"checkpoint {where} is cut short ({os.path.getsize(path)} bytes, its zip archive has no end record): the "
                f"write was interrupted or the copy is incomplete; re-copy it or use another checkpoint of the run"
            ) from None
        raise ValueError(damaged(where, error)) from None
    if bad is not None:
        raise ValueError(
            f"checkpoint {where} is damaged: the checksum of its record {bad} does not match (bytes changed on disk or in "
            f"transfer); re-copy it or use another checkpoint of the run"
        )


def damaged(where: str, error: BaseException) -> str:
    """The line for a checkpoint whose archive cannot be read (cut short, bytes changed)."""
    reason = " ".join(str(error).split())
    reason = reason[:120] + ("…" if len(reason) > 120 else "")
    return (
        f"checkpoint {where} is damaged ({type(error).__name__}: {reason}): the file is cut short or its bytes changed; "
        f"re-copy it or use another checkpoint of the run"
    )


def project_class(class_path: Any, base: type, setting: str, where: str) -> type:
    """The class ``class_path`` names, imported only if it lies in one of :data:`PROJECT_PACKAGES`
    and is a subclass of ``base``; anything else is refused with one line (nothing is imported
    outside the project's packages)."""
    refused = (
        f"checkpoint {where} names {setting} {class_path!r}, which is not a "
        f"{'class' if base is object else base.__name__} of the project's packages "
        f"({', '.join(PROJECT_PACKAGES)}): refused, nothing was imported"
    )
    if not isinstance(class_path, str) or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", class_path):
        raise ValueError(refused)
    module_name, _, name = class_path.rpartition(".")
    if module_name.split(".")[0] not in PROJECT_PACKAGES:
        raise ValueError(refused)
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        raise ValueError(
            f"checkpoint {where} names {setting} {class_path!r}, which does not exist in this version of the project "
            f"(was it written by another version?)"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(refused)
    return cls


def check_class_paths(checkpoint: dict[str, Any], where: str) -> None:
    """Refuse a checkpoint that names a class outside the project or of the wrong kind: the task
    (``hyper_parameters._class_path``, ``headbench.task``), the datamodule, the head and any nested
    ``class_path`` (encoders), and an instantiator other than Lightning's."""
    import lightning.pytorch as pl

    from heads.base import OutputHead

    hparams = checkpoint.get("hyper_parameters") or {}
    data_hparams = checkpoint.get("datamodule_hyper_parameters") or {}
    origin = checkpoint.get("headbench") or {}
    for mapping in (hparams, data_hparams):
        if not isinstance(mapping, dict):
            raise ValueError(f"checkpoint {where} has hyper-parameters of type {type(mapping).__name__}, not a dictionary: it is damaged")
        instantiator = mapping.get("_instantiator")
        if instantiator is not None and instantiator not in TRUSTED_INSTANTIATORS:
            raise ValueError(
                f"checkpoint {where} names the instantiator {instantiator!r}; only {', '.join(TRUSTED_INSTANTIATORS)} is "
                f"allowed: refused, nothing was imported"
            )
    if "_class_path" in hparams:
        project_class(hparams["_class_path"], pl.LightningModule, "the model class", where)
    if "task" in origin:
        project_class(origin["task"], pl.LightningModule, "the model class", where)
    if "head" in origin:
        project_class(origin["head"], OutputHead, "the head class", where)
    for key in ("datamodule_class_path",):
        if key in checkpoint:
            project_class(checkpoint[key], pl.LightningDataModule, "the datamodule class", where)
    if "_class_path" in data_hparams:
        project_class(data_hparams["_class_path"], pl.LightningDataModule, "the datamodule class", where)
    for key, value in hparams.items():
        for setting, class_path in nested_class_paths(value, f"model.init_args.{key}"):
            base = OutputHead if setting == "model.init_args.head" else torch.nn.Module
            project_class(class_path, base, setting, where)
        # A head given by name (``head: mos``, Hybrid-LightRNN's ``inner``) is resolved by
        # heads.registry.head_class, which imports a dotted name: the same rule applies.
        for setting, name in head_names(value, f"model.init_args.{key}", key):
            project_class(name, OutputHead, setting, where)


def check_hyper_parameters(checkpoint: dict[str, Any], where: str) -> None:
    """Refuse hyper-parameters the checkpoint's own classes do not take, and dotted names outside
    the project where a class is expected.

    They are passed to the model's and datamodule's constructors (through the CLI's parser, which
    imports a dotted string given for a callable such as ``optimizer``): an unknown key would end
    in a constructor's ``TypeError`` traceback or a parser dump, and ``optimizer: some.module``
    would import ``some.module``. Checkpoints that name no class are left to the caller."""
    import inspect
    import typing

    import lightning.pytorch as pl

    origin = checkpoint.get("headbench") or {}
    for kind, base, mapping, class_path in (
        ("model", pl.LightningModule, checkpoint.get("hyper_parameters") or {},
         (checkpoint.get("hyper_parameters") or {}).get("_class_path") or origin.get("task")),
        ("datamodule", pl.LightningDataModule, checkpoint.get("datamodule_hyper_parameters") or {},
         checkpoint.get("datamodule_class_path") or (checkpoint.get("datamodule_hyper_parameters") or {}).get("_class_path")),
    ):
        if not mapping or not class_path:
            continue
        cls = project_class(class_path, base, f"the {kind} class", where)
        parameters = inspect.signature(cls.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            continue
        for key, value in mapping.items():
            if key.startswith("_"):
                continue
            if key not in parameters:
                raise ValueError(
                    f"checkpoint {where} has the {kind} hyper-parameter {key!r}, which {cls.__name__} does not take: "
                    f"it was edited or written by another version of the project"
                )
            annotation = parameters[key].annotation
            if isinstance(annotation, str):  # postponed annotations (from __future__ import annotations)
                takes_text = bool(re.search(r"\bstr\b|Literal|Path|\bAny\b", annotation))
            else:
                takes_text = (annotation is str or annotation is inspect.Parameter.empty or str in typing.get_args(annotation)
                              or typing.get_origin(annotation) is typing.Literal)
            if isinstance(value, str) and not takes_text and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", value):
                project_class(value, object, f"{kind}.init_args.{key}", where)


#: Arguments that take a head by name (:data:`heads.registry.HeadSpec`).
HEAD_NAME_ARGUMENTS = ("head", "inner")


def head_names(value: Any, setting: str, key: str) -> list[tuple[str, str]]:
    """``(setting, name)`` of every dotted head name (``head: pkg.Class``) inside ``value``."""
    found = []
    if isinstance(value, str) and key in HEAD_NAME_ARGUMENTS and "." in value:
        found.append((setting, value))
    elif isinstance(value, dict):
        for inner_key, inner in value.items():
            found += head_names(inner, f"{setting}.{inner_key}", inner_key)
    elif isinstance(value, (list, tuple)):
        for index, inner in enumerate(value):
            found += head_names(inner, f"{setting}[{index}]", key)
    return found


def nested_class_paths(value: Any, setting: str) -> list[tuple[str, Any]]:
    """``(setting, class_path)`` of every ``{"class_path": ...}`` inside ``value``."""
    found = []
    if isinstance(value, dict):
        if "class_path" in value:
            found.append((setting, value["class_path"]))
        for key, inner in value.items():
            found += nested_class_paths(inner, f"{setting}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, inner in enumerate(value):
            found += nested_class_paths(inner, f"{setting}[{index}]")
    return found


def model_from_checkpoint(
    checkpoint: dict[str, Any], where: str, model_class: type | None = None, datamodule: Any | None = None
) -> Any:
    """The LightningModule a checkpoint (read by :func:`read_checkpoint`) describes, with its
    weights, built without reading the file again.

    What ``LightningModule.load_from_checkpoint`` does, on the dictionary already read: the
    hyper-parameters that are ``__init__`` arguments are passed to Lightning's own instantiator
    (which turns ``class_path`` / ``init_args`` parts such as the head into objects), then
    ``on_load_checkpoint`` (head structure, origin checks) and the state dict. With
    ``datamodule``, the checkpoint's task, head and data fingerprint are compared with the model
    and that data first (:func:`datamodules.fingerprint.origin_mismatch`), naming ``where``.
    """
    import inspect

    import lightning.pytorch as pl
    from lightning.pytorch.cli import instantiate_module

    from datamodules.fingerprint import checkpoint_origin, origin_mismatch

    hparams = dict(checkpoint.get("hyper_parameters") or {})
    if model_class is None:
        class_path = hparams.get("_class_path") or (checkpoint.get("headbench") or {}).get("task")
        if class_path is None:
            raise ValueError(f"checkpoint {where} names no model class (no hyper_parameters._class_path): write it with python -m app fit")
        model_class = project_class(class_path, pl.LightningModule, "the model class", where)
    checkpoint = upgrade_checkpoint(checkpoint, where, model_class)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    saved = checkpoint.get("headbench")
    if saved is not None:  # another task's checkpoint: say so before its hyper-parameters fail to fit
        problem = origin_mismatch({"task": saved.get("task")}, {"task": f"{model_class.__module__}.{model_class.__qualname__}"})
        if problem:
            raise ValueError(f"checkpoint {where} {problem}")
    parameters = inspect.signature(model_class.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    kwargs = {k: v for k, v in hparams.items() if not k.startswith("_") and (takes_any or k in parameters)}
    if hparams.get("_instantiator") is not None:
        model = instantiate_module(model_class, kwargs)
    else:
        model = model_class(**kwargs)
    if saved is not None:
        adopts = getattr(model, "adopts_checkpoint_vocabulary", False)
        problem = origin_mismatch(saved, checkpoint_origin(model, None if adopts else datamodule))
        if problem:
            raise ValueError(f"checkpoint {where} {problem}")
    model.on_load_checkpoint(checkpoint)
    strict = True if model.strict_loading is None else model.strict_loading
    try:
        model.load_state_dict(checkpoint["state_dict"], strict=strict)
    except RuntimeError as error:
        first = str(error).splitlines()[1].strip() if len(str(error).splitlines()) > 1 else str(error)
        raise ValueError(
            f"checkpoint {where} does not fit {model_class.__name__} built from its own hyper-parameters ({first}): "
            f"it is damaged or was edited"
        ) from None
    return model


def model_and_data(path: str, checkpoint: dict[str, Any] | None = None, default_task: str | None = None) -> tuple[Any, Any]:
    """Model and datamodule rebuilt from a checkpoint file alone (class paths and hyper-parameters
    inside, read once through :func:`read_checkpoint`); the checkpoint's data fingerprint is
    compared with the rebuilt datamodule's. ``default_task`` is the model class of checkpoints
    that do not name one."""
    import lightning.pytorch as pl

    checkpoint = read_checkpoint(path) if checkpoint is None else checkpoint
    data_path = checkpoint.get("datamodule_class_path")
    if data_path is None:
        raise ValueError(f"checkpoint {path} has no datamodule_class_path: write it with a HeadTask run (python -m app fit)")
    data_class = project_class(data_path, pl.LightningDataModule, "the datamodule class", path)
    data_hparams = {k: v for k, v in (checkpoint.get("datamodule_hyper_parameters") or {}).items() if not k.startswith("_")}
    datamodule = data_class(**data_hparams)
    hparams = checkpoint.get("hyper_parameters") or {}
    model_class = None
    if not hparams.get("_class_path") and not (checkpoint.get("headbench") or {}).get("task") and default_task:
        model_class = project_class(default_task, pl.LightningModule, "the model class", path)
    return model_from_checkpoint(checkpoint, path, model_class, datamodule), datamodule


# ---------------------------------------------------------------------- writing
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


def write_output(path: str, data: bytes | str, option: str) -> None:
    """Write an analysis output (a report, a figure) atomically; ``option`` is the flag that
    chooses its directory, named in the error line."""
    write_atomically(path, data, "output", f"free space or pass another {option}")


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


# ---------------------------------------------------------------------- the CLI's --ckpt_path
#: ``--ckpt_path`` values Lightning resolves itself to a file of the run.
SYMBOLIC_CKPT_PATHS = ("last", "best", "hpc", "registry")


def checkpoint_model_config(ckpt_path: Any, configured_class_path: str | None) -> dict[str, Any] | None:
    """The model configuration a ``--ckpt_path`` file supplies to the CLI (what Lightning's
    ``LightningCLI._parse_ckpt_path`` merges into the parsed config), read through
    :func:`read_checkpoint` instead of a second ``torch.load``: ``{"class_path", "dict_kwargs"}``,
    or ``None`` when it has no hyper-parameters or the path is symbolic (``last``, ``best``: the
    Trainer resolves and reads it, through :class:`AtomicCheckpointIO`).

    Refuses, before anything is built, a checkpoint of another task than ``configured_class_path``
    (the model class the user's config names, if any)."""
    text = os.fspath(ckpt_path)
    if text in SYMBOLIC_CKPT_PATHS or text.startswith("registry"):
        return None
    checkpoint = read_checkpoint(text)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    saved = hparams.get("_class_path") or (checkpoint.get("headbench") or {}).get("task")
    if saved and configured_class_path:
        import lightning.pytorch as pl

        saved_class = project_class(saved, pl.LightningModule, "the model class", text)
        module_name, _, name = str(configured_class_path).rpartition(".")
        try:
            configured = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, ValueError):
            configured = None  # the parser reports an unknown model class itself
        if configured is not None and configured is not saved_class:
            from datamodules.fingerprint import origin_mismatch

            full = lambda cls: f"{cls.__module__}.{cls.__qualname__}"  # noqa: E731
            raise ValueError(f"checkpoint {text} {origin_mismatch({'task': full(saved_class)}, {'task': full(configured)})}")
    if not hparams:
        return None
    if "_class_path" in hparams:
        return {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
    return hparams
