"""Run directories: ``runs/<Data>-<head>/version_N`` naming, version reservation between
processes, and the writability check of output directories done before anything is built."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from jsonargparse import Namespace

import heads

#: Version directories this process reserved; removed again if the run left them empty.
RESERVED_VERSIONS: list[Path] = []


def is_launching_process() -> bool:
    """True unless this is a non-zero rank of a distributed launch (those log nothing)."""
    return all(os.environ.get(key, "0") == "0" for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def reserve_version(root: Path) -> int:
    """Create ``root/version_N`` for the next free N and return N (safe between processes)."""
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name[8:]) for p in root.glob("version_*") if p.name[8:].isdigit()]
    version = max(taken, default=-1) + 1
    while True:
        try:
            (root / f"version_{version}").mkdir()
        except FileExistsError:
            version += 1
            continue
        RESERVED_VERSIONS.append(root / f"version_{version}")
        return version


def release_unused_versions() -> None:
    """Remove reserved version directories a run never wrote to (it failed before logging)."""
    while RESERVED_VERSIONS:
        path = RESERVED_VERSIONS.pop()
        try:
            path.rmdir()  # only succeeds when empty
        except OSError:
            pass


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


def run_name(config: Namespace) -> str:
    """``<data>-<head>`` from the configured class names, e.g. ``SyntheticLM-mos``."""
    data = config.data.class_path.rpartition(".")[2] if isinstance(config.data, Namespace) else "data"
    head = config.model.init_args.get("head", "softmax") if isinstance(config.model, Namespace) else "softmax"
    if isinstance(head, Namespace):
        head_cls = head.class_path.rpartition(".")[2]
        head = getattr(heads.registry._REGISTRY.get(head_cls), "short_name", None) or next(
            (n for n, c in heads.registry._REGISTRY.items() if c.__name__ == head_cls), head_cls
        )
    return f"{data}-{head}"


