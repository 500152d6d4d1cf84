"""User-error formatting for the CLI: parser errors and wrapped ``ValueError``s become the one
line documented in docs/bad_inputs.md."""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
from pathlib import Path

import lightning.pytorch as pl

import datamodules
import tasks


def check_config_files(argv: list[str]) -> None:
    """Refuse a ``--config`` file that is not UTF-8 with one line naming it (the parser would
    report a bare ``UnicodeDecodeError`` without the file)."""
    for position, arg in enumerate(argv):
        if arg in ("--config", "-c") and position + 1 < len(argv):
            path = argv[position + 1]
        elif arg.startswith("--config="):
            path = arg.partition("=")[2]
        else:
            continue
        if not os.path.isfile(path):
            continue  # the parser reports a missing file itself
        data = Path(path).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"config file {path} is not UTF-8 (byte 0x{data[error.start]:02x} at offset {error.start}); "
                f"save it as UTF-8 YAML"
            ) from None


def root_user_error(error: BaseException) -> BaseException:
    """The innermost one-line ``ValueError`` behind an error that jsonargparse wrapped while
    trying each type of a Union, so users see our message rather than the parser's dump."""
    found, seen = error, set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ValueError) and "\n" not in str(current).strip():
            found = current
        current = current.__cause__ or current.__context__
    return found


_CLASS_PATH_PROBLEM = re.compile(r"Problem with given class_path '([^']*)':\s*\n((?:\s{6,}.*\n?)+)")
_UNKNOWN_CLASS = ("No module named", "has no attribute", "not a subclass", "does not correspond", "Unable to")


def argument_error_line(message: str) -> str:
    """One line for a jsonargparse parse error (they arrive as multi-line Union dumps).

    An unknown ``model``/``data`` class path lists the classes that exist; any other error
    keeps the parser key, the value given and what was expected."""
    key_match = re.match(r'Parser key "([^"]+)":', message)
    key = key_match.group(1) if key_match else None
    not_subclass = re.search(r"does not correspond to a subclass of (\w+)", message)
    if not_subclass and key in ("model", "data"):
        given = re.search(r"Given value: (.*)", message)
        value = given.group(1).strip() if given else "?"
        inner = re.search(r"'class_path': '([^']*)'", value)
        return (
            f"{key} class_path {inner.group(1) if inner else value!r} is not a {not_subclass.group(1)}: "
            f"valid are {', '.join(available_classes(key))} (set {key}.class_path in the config or --{key})"
        )
    problem = _CLASS_PATH_PROBLEM.search(message)
    if problem and key in ("model", "data"):
        class_path, detail = problem.group(1), " ".join(problem.group(2).split())
        if any(marker in detail for marker in _UNKNOWN_CLASS):
            valid = ", ".join(available_classes(key))
            return (
                f"unknown {key} class_path {class_path!r} ({detail}): valid are {valid} "
                f"(set {key}.class_path in the config or --{key} on the command line)"
            )
        return f"{key} {class_path}: {detail} (see python -m app fit --{key}.help {class_path})"
    missing_file = re.search(r"File does not exist: (.*)", message)
    if key == "config" and missing_file:
        return f"config file {missing_file.group(1).strip()} does not exist (check the --config path)"
    if key is not None:
        given = re.search(r"Given value: (.*)", message)
        expected = re.findall(r"- (Expected a .*)", message)
        reason = "; ".join(expected) or " ".join(message.split("\n", 1)[-1].split())
        value = f" {given.group(1).strip()!r}" if given else ""
        return f"invalid value{value} for {key}: {reason} (fix --{key} or its entry in the config)"
    return " ".join(message.split())


def available_classes(kind: str) -> list[str]:
    """Concrete LightningModules under ``tasks`` (kind ``model``) or LightningDataModules under
    ``datamodules`` (kind ``data``), by the shortest class path the CLI accepts."""
    package, base = (tasks, pl.LightningModule) if kind == "model" else (datamodules, pl.LightningDataModule)
    for module in pkgutil.iter_modules(package.__path__):
        try:
            importlib.import_module(f"{package.__name__}.{module.name}")
        except ImportError:  # an optional dependency missing: its classes are not offered
            continue
    found, stack = [], list(base.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__.startswith(package.__name__ + ".") and not cls.__subclasses__():
            short = f"{package.__name__}.{cls.__name__}"
            found.append(short if getattr(package, cls.__name__, None) is cls else f"{cls.__module__}.{cls.__name__}")
    return sorted(set(found))


