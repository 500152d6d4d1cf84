"""Run directories: ``runs/<Data>-<head>/version_N`` naming, version reservation between
processes, and the writability check of output directories done before anything is built."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.callbacks import Callback

import heads
from datamodules.files import DISK_ERRORS

#: Version directories this process reserved; removed again if the run left them empty.
RESERVED_VERSIONS: list[Path] = []
#: Directories created to hold them (``runs/``, ``runs/<name>/``), removed again when left empty.
CREATED_ROOTS: list[Path] = []
#: Set once the run has processed its first batch (:class:`RunStarted`): from then on its
#: directories hold results (events, config, checkpoints) and are never removed.
STARTED: list[bool] = []


def is_launching_process() -> bool:
    """True unless this is a non-zero rank of a distributed launch (those log nothing)."""
    return all(os.environ.get(key, "0") == "0" for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def reserve_version(root: Path, prefix: str = "version_") -> int:
    """Create ``root/<prefix>N`` (``version_N``) for the next free N and return N (safe between
    processes)."""
    missing = [p for p in (root, *root.parents) if not p.exists()]
    root.mkdir(parents=True, exist_ok=True)
    CREATED_ROOTS.extend(p for p in missing if p not in CREATED_ROOTS)
    taken = [int(p.name[len(prefix):]) for p in root.glob(f"{prefix}*") if p.name[len(prefix):].isdigit()]
    version = max(taken, default=-1) + 1
    while True:
        try:
            (root / f"{prefix}{version}").mkdir()
        except FileExistsError:
            version += 1
            continue
        except FileNotFoundError:  # a refused run started beside this one removed the empty root
            root.mkdir(parents=True, exist_ok=True)
            continue
        RESERVED_VERSIONS.append(root / f"{prefix}{version}")
        return version


def evaluation_log_directory(save_dir: Path, name: str, ckpt_path: object, subcommand: str) -> tuple[Path, str, str]:
    """``(save_dir, name, version)`` of the logger of ``validate|test|predict``: the evaluated
    run's own directory when the checkpoint is one of a run's (``<save_dir>/<name>/version_N/
    checkpoints/last.ckpt`` gives ``version_N/test-last``: one directory per command and
    checkpoint, so the best and the last checkpoint are told apart), else ``<subcommand>_K`` for
    the next free K under ``<save_dir>/<name>``. Never a ``version_N`` of its own: those are
    training runs. A directory this creates is given back if the command is refused before its
    first batch."""
    path = Path(str(ckpt_path)).expanduser().absolute() if ckpt_path else None
    if path is not None and path.parent.name == "checkpoints" and path.parent.parent.name.startswith("version_"):
        run = path.parent.parent
        target = run / f"{subcommand}-{path.stem}"
        if not target.exists() and is_launching_process():
            target.mkdir()
            RESERVED_VERSIONS.append(target)
        return run.parent.parent, run.parent.name, f"{run.name}/{target.name}"
    root = save_dir / name
    if not is_launching_process():
        return save_dir, name, subcommand  # other ranks log nothing
    return save_dir, name, f"{subcommand}_{reserve_version(root, f'{subcommand}_')}"


class RunStarted(Callback):
    """Records that the run processed its first batch (training, or evaluation outside the
    sanity check): after that, what it wrote is a result and its directories are kept."""

    def on_train_batch_end(self, *args: Any) -> None:
        STARTED.append(True)

    def on_validation_batch_end(self, trainer: Any, *args: Any) -> None:
        if not trainer.sanity_checking:
            STARTED.append(True)

    def on_test_batch_end(self, *args: Any) -> None:
        STARTED.append(True)

    def on_predict_batch_end(self, *args: Any) -> None:
        STARTED.append(True)


def release_unused_versions(refused: bool = False) -> None:
    """Remove reserved version directories a run never wrote to (it failed before logging).

    ``refused``: the run stopped on a user error before its first batch (a foreign checkpoint
    found while restoring, bad data met in ``setup``), possibly after the logger wrote its
    ``config.yaml`` and an events file; its own reserved directory goes too, so a refused run
    leaves nothing behind. A run that processed a batch (:class:`RunStarted`) keeps everything,
    whatever stopped it: its logs are the user's, wherever its checkpoints went."""
    refused = refused and not STARTED
    STARTED.clear()
    while RESERVED_VERSIONS:
        path = RESERVED_VERSIONS.pop()
        try:
            if refused and path.is_dir() and not any(path.rglob("*.ckpt")):
                shutil.rmtree(path)
            else:
                path.rmdir()  # only succeeds when empty
        except OSError:
            pass
    for path in sorted(CREATED_ROOTS, key=lambda p: len(p.parts), reverse=True):  # deepest first
        try:
            path.rmdir()  # only succeeds when empty: runs/<name>/, then runs/ if this process made it
        except OSError:
            pass
    CREATED_ROOTS.clear()


def check_writable_directory(path: str | os.PathLike, option: str) -> None:
    """Raise one ``ValueError`` line unless ``path`` is (or can be created as) a directory
    this process can write to. Nothing is created: the nearest existing ancestor is probed
    with a temporary file that is removed at once. Remote URLs (``s3://``...) are not checked."""
    text = os.fspath(path)
    if "://" in text:
        return
    target = Path(text).expanduser().absolute()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    fix = f"pass a writable directory with --{option}"
    if not existing.is_dir():
        raise ValueError(f"{option} {text} cannot be created: {existing} is a file, not a directory ({fix})")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ValueError(
            f"{option} {text} is not writable: cannot create files in {existing} ({error.strerror}); {fix}"
        ) from None


#: Write errors that mean the disk under the run's directories cannot take more (full, over
#: quota, the file-size limit, read-only), as opposed to a missing or unreadable input.
DISK_FULL_ERRORS = DISK_ERRORS - {errno.EACCES, errno.EPERM}


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` is a write the disk refused (:data:`DISK_FULL_ERRORS`) that no project
    writer has already turned into its own line (those are ``ValueError`` s too)."""
    return isinstance(error, OSError) and not isinstance(error, ValueError) and error.errno in DISK_FULL_ERRORS


def quiet_disk_full_in_threads(previous: Any) -> Any:
    """A ``threading.excepthook`` that leaves out a writer thread's disk-full error (TensorBoard's
    event writer): the writer raises it again in the run's own thread at its next flush, where it
    becomes the run's one line; any other thread error goes to ``previous``."""
    def hook(args: Any) -> None:
        if not is_disk_full(args.exc_value):
            previous(args)
    return hook


def disk_full_line(error: OSError, log_dir: str | None) -> str:
    """The one line for a run that stopped because its disk is full: the file (or the run's log
    directory), the system's reason, what is kept and the fix."""
    where = error.filename or (f"the run's logs in {log_dir}" if log_dir else "the run's output")
    kept = "its logs and checkpoints so far are kept" if STARTED else "nothing of this run is kept"
    return (
        f"cannot write {where}: {os.strerror(error.errno)}; the run stopped and {kept}; "
        f"free space on that disk or pass another --trainer.logger.init_args.save_dir"
    )


def remove_empty_logs(log_dir: str | os.PathLike | None) -> None:
    """Remove the empty files a write on a full disk leaves in a kept run's log directory (an
    events file or ``hparams.yaml`` / ``config.yaml`` created but never filled): what stays holds data."""
    if log_dir is None or not os.path.isdir(log_dir):
        return
    for path in Path(log_dir).iterdir():
        empty_log = path.name.startswith("events.out.tfevents.") or path.name in ("hparams.yaml", "config.yaml")
        if empty_log and path.is_file() and not path.is_symlink() and path.stat().st_size == 0:
            path.unlink()


def run_name(config: Namespace) -> str:
    """``<data>-<head>`` from the configured class names, e.g. ``SyntheticLM-mos``."""
    data = config.data.class_path.rpartition(".")[2] if isinstance(config.data, Namespace) else "data"
    head = config.model.init_args.get("head", "softmax") if isinstance(config.model, Namespace) else "softmax"
    if isinstance(head, Namespace):
        head_cls = head.class_path.rpartition(".")[2]
        head = heads.registry.short_name(head_cls) or head_cls
    return f"{data}-{head}"




# ------------------------------------------------------------------ resume
def newest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint a resume continues from: the newest ``last*.ckpt`` in ``directory`` (by
    modification time, as Lightning's ``ckpt_path="last"``), else the newest ``*.ckpt``."""
    files = [p for p in directory.glob("*.ckpt") if p.is_file()] if directory.is_dir() else []
    pool = [p for p in files if p.name.startswith("last")] or files
    return max(pool, key=lambda p: p.stat().st_mtime) if pool else None


def versioned_logger_root(config: Namespace) -> Path | None:
    """``<save_dir>/<name>`` of a configured logger that numbers ``version_N`` directories
    (``None`` when the logger is off or not configured by ``init_args.save_dir``)."""
    logger = config.trainer.get("logger")
    init_args = logger.get("init_args") if isinstance(logger, Namespace) else None
    if not init_args or not init_args.get("save_dir") or "://" in str(init_args.save_dir):
        return None
    name = init_args.get("name")
    if name == "auto":
        name = run_name(config)
    return Path(init_args.save_dir).expanduser().absolute() / (name or "")


def version_directory(root: Path, version: int | str) -> Path:
    """Lightning's layout: an int version is ``version_N``, a string is used as the name."""
    return root / (version if isinstance(version, str) else f"version_{version}")


def refuse_best(subcommand: str) -> None:
    """``--ckpt_path best`` in one line. Lightning's ``"best"`` is the best checkpoint of a ``fit``
    run earlier in the same process, which a command of its own never has (Lightning then says
    ``ModelCheckpoint`` "is not configured to save the best model", which is not the problem).
    ``fit`` resumes a run from where it stopped, which is its last checkpoint, never its best."""
    if subcommand == "fit":
        raise ValueError(
            "--ckpt_path best: fit resumes a run where it stopped, and best checkpoints are for evaluation (test "
            "--ckpt_path <its best-*.ckpt file>): to resume use --ckpt_path last (or the path of a .ckpt file)"
        )
    raise ValueError(
        f"--ckpt_path best: {subcommand} runs in a new process, which has no best checkpoint of its own: pass the "
        f"best checkpoint's file, runs/<Data>-<head>/version_N/checkpoints/best-epoch=E-step=S.ckpt (fit prints it), "
        f"or --ckpt_path last"
    )


def resolve_resume(config: Namespace, subcommand: str) -> None:
    """Turn ``--ckpt_path last`` into the checkpoint file it means, or refuse it (and
    ``--ckpt_path best``, :func:`refuse_best`).

    Without ``--checkpoint.dirpath`` every run has its own ``<save_dir>/<name>/version_N``, so
    Lightning's own ``"last"`` (searched in the *new* run's empty directory) never finds
    anything and trains from scratch with a warning. Here ``last`` is the newest checkpoint of
    the newest ``version_N`` of this configuration's run name that has one (of the given
    ``version`` if one is set), or of ``checkpoint.dirpath`` when that is set; ``fit`` then
    logs into that same version directory, so the resumed run continues its TensorBoard stream
    and its checkpoints. ``fit --ckpt_path FILE`` with a file inside
    ``<save_dir>/<name>/version_N/checkpoints`` continues version ``N`` as well. Nothing found
    is a one-line ``ValueError``."""
    ckpt_path = config.get("ckpt_path")
    if not ckpt_path:
        return
    if ckpt_path == "best":
        refuse_best(subcommand)
    dirpath = config.get("checkpoint", {}).get("dirpath") if config.get("checkpoint") else None
    root = versioned_logger_root(config)
    logger_args = config.trainer.logger.init_args if root is not None else None
    reuse_version = subcommand == "fit" and root is not None and logger_args.get("version") is None and not dirpath
    if ckpt_path != "last":
        path = Path(str(ckpt_path)).expanduser().absolute()
        if reuse_version and path.is_file() and path.parent.name == "checkpoints" and path.parent.parent.parent == root:
            match = path.parent.parent.name
            if match.startswith("version_") and match[8:].isdigit():
                logger_args.version = int(match[8:])
        return
    if subcommand == "fit":
        fresh = "no checkpoint to resume in {}; start a fresh run without --ckpt_path"
    else:
        fresh = "no checkpoint to load in {}; train one with python -m app fit or pass --ckpt_path FILE"
    if dirpath:
        if "://" in str(dirpath):
            return  # remote storage: Lightning's own search
        looked = Path(str(dirpath)).expanduser().absolute()
        found = newest_checkpoint(looked)
        if found is None:
            raise ValueError("--ckpt_path last: " + fresh.format(f"{looked} (checkpoint.dirpath)"))
        config.ckpt_path = str(found)
        return
    if root is None:
        if config.trainer.get("logger") not in (False, None):
            return  # a logger configured otherwise: Lightning's own search
        looked = Path(config.trainer.get("default_root_dir") or os.getcwd()).absolute() / "checkpoints"
        found = newest_checkpoint(looked)
        if found is None:
            raise ValueError("--ckpt_path last: " + fresh.format(looked))
        config.ckpt_path = str(found)
        return
    version = logger_args.get("version")
    if version is not None:
        candidates = [(version, version_directory(root, version))]
    else:
        numbered = [p for p in root.glob("version_*") if p.name[8:].isdigit()] if root.is_dir() else []
        candidates = sorted(((int(p.name[8:]), p) for p in numbered), reverse=True)
    for number, run_dir in candidates:
        found = newest_checkpoint(run_dir / "checkpoints")
        if found is not None:
            config.ckpt_path = str(found)
            if subcommand == "fit":
                logger_args.version = number
            return
    where = version_directory(root, version) if version is not None else root / "version_*"
    raise ValueError("--ckpt_path last: " + fresh.format(f"{where}/checkpoints"))


def checkpoint_directory(trainer) -> Path | None:
    """Where the trainer's ``ModelCheckpoint`` writes, computed before ``fit`` resolves it
    itself in ``setup`` (the same rule as Lightning 2.6's private
    ``ModelCheckpoint.__resolve_ckpt_dir``; ``tests/test_runs.py`` pins the agreement). ``None``
    without a ``ModelCheckpoint`` or for remote storage."""
    callback = trainer.checkpoint_callback
    if callback is None:
        return None
    if callback.dirpath:
        path = str(callback.dirpath)
    elif trainer.loggers:
        logger = trainer.loggers[0]
        save_dir = logger.save_dir or trainer.default_root_dir
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        path = os.path.join(str(save_dir), str(logger.name), version, "checkpoints")
    else:
        path = os.path.join(trainer.default_root_dir, "checkpoints")
    return None if "://" in path else Path(path)
