"""The classes a checkpoint may name (the allow-list, :func:`project_class`) and the checks of
what a checkpoint's hyper-parameters may hold (:func:`check_class_paths`, :func:`check_hyper_parameters`)."""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any

import torch


#: How deep a checkpoint's hyper-parameters may nest (a project config is a few levels deep);
#: deeper is refused as damaged instead of walked.
MAX_DEPTH = 32


def check_depth(depth: int, setting: str, where: str) -> None:
    """Refuse hyper-parameters nested deeper than :data:`MAX_DEPTH` (also a cycle), naming where."""
    if depth > MAX_DEPTH:
        raise ValueError(
            f"checkpoint {where} has hyper-parameters nested deeper than {MAX_DEPTH} levels (at {setting[:80]}…): "
            f"it is damaged or was edited; use a checkpoint written by python -m app fit"
        )


#: A dotted name, ``package.module.Class``: what the parser imports when it is given one.
DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")

#: Packages whose classes a checkpoint may name.
PROJECT_PACKAGES = ("tasks", "datamodules", "heads")

#: Lightning's own instantiator, the only one a checkpoint may name (``_instantiator`` key).
TRUSTED_INSTANTIATORS = ("lightning.pytorch.cli.instantiate_module",)


def project_class(class_path: Any, base: type, setting: str, where: str) -> type:
    """The class ``class_path`` names, imported only if it lies in one of :data:`PROJECT_PACKAGES`
    and is a subclass of ``base``; anything else is refused with one line (nothing is imported
    outside the project's packages)."""
    refused = (
        f"checkpoint {where} names {setting} {class_path!r}, which is not a "
        f"{'class' if base is object else base.__name__} of the project's packages "
        f"({', '.join(PROJECT_PACKAGES)}): refused, nothing was imported"
    )
    if not isinstance(class_path, str) or not DOTTED_NAME.fullmatch(class_path):
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
        for setting, class_path in nested_class_paths(value, f"model.init_args.{key}", where):
            base = OutputHead if setting == "model.init_args.head" else torch.nn.Module
            project_class(class_path, base, setting, where)
        # A head given by name (``head: mos``, Hybrid-LightRNN's ``inner``) is resolved by
        # heads.registry.head_class, which imports a dotted name: the same rule applies.
        for setting, name in head_names(value, f"model.init_args.{key}", key, where):
            project_class(name, OutputHead, setting, where)


def check_hyper_parameters(checkpoint: dict[str, Any], where: str) -> None:
    """Refuse hyper-parameters the checkpoint's own classes do not take, and dotted names outside
    the project where a class is expected.

    They are passed to the model's and datamodule's constructors (through the CLI's parser, which
    imports a dotted string given for a callable such as ``optimizer``): an unknown key would end
    in a constructor's ``TypeError`` traceback or a parser dump, and ``optimizer: some.module``
    would import ``some.module``. Checkpoints that name no class are left to the caller."""
    import inspect

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
            if isinstance(value, str) and not takes_text(parameters[key].annotation):
                check_text_for_class(value, f"{kind}.init_args.{key}", where)


def takes_text(annotation: Any) -> bool:
    """Whether a constructor argument annotated ``annotation`` takes a string as a string (``str``,
    a ``Literal``, a path, no annotation); otherwise the CLI's parser interprets a string given to
    it (a class path, YAML text or the path of a config file)."""
    import inspect
    import typing

    if isinstance(annotation, str):  # postponed annotations (from __future__ import annotations)
        return bool(re.search(r"\bstr\b|Literal|Path|\bAny\b", annotation))
    return (annotation is str or annotation is inspect.Parameter.empty or str in typing.get_args(annotation)
            or typing.get_origin(annotation) is typing.Literal)


def check_text_for_class(value: str, setting: str, where: str) -> None:
    """Refuse a checkpoint string given where a class is expected unless it is a plain name or a
    dotted class of the project (:func:`project_class`). The parser would read any other string
    as YAML (``{class_path: some.module.Class}``, which it imports) or as the path of a config
    file to read (a file, a pipe): the allow-list would never see the class it names."""
    if DOTTED_NAME.fullmatch(value):
        project_class(value, object, setting, where)
    elif not re.fullmatch(r"[A-Za-z_][\w-]*", value) or os.path.lexists(value):
        shown = " ".join(value.split())
        raise ValueError(
            f"checkpoint {where} gives {setting} the text {shown[:60]!r}{'…' if len(shown) > 60 else ''} where a class is "
            f"expected, which the parser would read as YAML or as a file to open: refused, nothing was imported or read; "
            f"use a checkpoint written by python -m app fit"
        )


#: Arguments that take a head by name (:data:`heads.registry.HeadSpec`).
HEAD_NAME_ARGUMENTS = ("head", "inner")


def head_names(value: Any, setting: str, key: str, where: str, depth: int = 0, seen: set[int] | None = None) -> list[tuple[str, str]]:
    """``(setting, name)`` of every dotted head name (``head: pkg.Class``) inside ``value``; each
    container is visited once (``seen``: ids) and the nesting is bounded (:func:`check_depth`)."""
    found: list[tuple[str, str]] = []
    seen = set() if seen is None else seen
    if isinstance(value, str) and key in HEAD_NAME_ARGUMENTS and "." in value:
        found.append((setting, value))
    elif isinstance(value, (dict, list, tuple)) and id(value) not in seen:
        seen.add(id(value))
        check_depth(depth, setting, where)
        items = value.items() if isinstance(value, dict) else ((key, inner) for inner in value)
        for index, (inner_key, inner) in enumerate(items):
            inner_setting = f"{setting}.{inner_key}" if isinstance(value, dict) else f"{setting}[{index}]"
            found += head_names(inner, inner_setting, inner_key, where, depth + 1, seen)
    return found


def nested_class_paths(value: Any, setting: str, where: str, depth: int = 0, seen: set[int] | None = None) -> list[tuple[str, Any]]:
    """``(setting, class_path)`` of every ``{"class_path": ...}`` inside ``value``; each container
    is visited once (``seen``: ids) and the nesting is bounded (:func:`check_depth`)."""
    found: list[tuple[str, Any]] = []
    seen = set() if seen is None else seen
    if not isinstance(value, (dict, list, tuple)) or id(value) in seen:
        return found
    seen.add(id(value))
    check_depth(depth, setting, where)
    if isinstance(value, dict):
        if "class_path" in value:
            found.append((setting, value["class_path"]))
        for key, inner in value.items():
            found += nested_class_paths(inner, f"{setting}.{key}", where, depth + 1, seen)
    else:
        for index, inner in enumerate(value):
            found += nested_class_paths(inner, f"{setting}[{index}]", where, depth + 1, seen)
    return found


# ---------------------------------------------------------------------- runtime options (app/checkpoint_io/policy.py)
def runtime_options(cls: type) -> tuple[str, ...]:
    """The constructor arguments of ``cls`` that only the command line may set."""
    return tuple(getattr(cls, "runtime_options", ()))


def check_saved_arguments(cls: type, init_args: dict[str, Any], entry: str, where: str) -> None:
    """Refuse a nested model part (head, encoder) whose saved ``init_args`` lack an argument of its
    class that has a default: ``fit`` saves every argument (the parser fills in the defaults), so a
    missing one was deleted, and the part would be built with the default instead of the trained
    value (another gate scale: other scores without a word). Arguments without a default are
    supplied by the task (sizes); runtime options are the command line's. Only applied to a file
    whose hyper-parameters LightningCLI wrote (they carry ``_class_path``): a model built in Python
    saves just the arguments it was given."""
    import inspect

    from tasks.checkpoint_fit import FIX

    try:
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return
    excluded = runtime_options(cls)
    for parameter in parameters:
        if (parameter.default is not inspect.Parameter.empty and parameter.name not in init_args and parameter.name not in excluded
                and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)):
            raise ValueError(
                f"checkpoint {where}: {entry} has no {parameter.name!r}, which python -m app fit saves with every argument of "
                f"{cls.__module__}.{cls.__qualname__} (it would be built with the default instead of the trained value); {FIX}")


def drop_runtime_options(checkpoint: dict[str, Any], where: str) -> dict[str, Any]:
    """``checkpoint`` without any runtime option in its model or datamodule hyper-parameters
    (nested ``class_path`` / ``init_args`` parts such as an encoder included). A task leaves its
    own runtime options out of the hyper-parameters it saves, so one in a file means the file was
    edited: one warning line on stderr names those. The datamodule's and nested parts' are saved
    as given (a record of the run) and are dropped without a word. Class paths must already have
    passed :func:`check_class_paths`."""
    import lightning.pytorch as pl

    dropped: list[str] = []
    hparams = checkpoint.get("hyper_parameters")
    model_path = (hparams or {}).get("_class_path") or (checkpoint.get("headbench") or {}).get("task")
    if isinstance(hparams, dict):
        model_class = project_class(model_path, pl.LightningModule, "the model class", where) if model_path else None
        # LightningCLI marks the hyper-parameters it saves with the model's class path and saves
        # every argument; a model built in Python saves only what it was given
        complete = "_class_path" in hparams
        checkpoint["hyper_parameters"] = _clean(hparams, model_class, "model.init_args", dropped, where, 0, {}, complete)
    data = checkpoint.get("datamodule_hyper_parameters")
    data_path = checkpoint.get("datamodule_class_path") or (data or {}).get("_class_path")
    if isinstance(data, dict):
        data_class = project_class(data_path, pl.LightningDataModule, "the datamodule class", where) if data_path else None
        checkpoint["datamodule_hyper_parameters"] = _clean(data, data_class, "data.init_args", dropped, where, 0, {}, False)
    if dropped:
        print(
            f"warning: checkpoint {where} sets {', '.join(dropped)}, which only the command line or its config files may "
            f"set (a checkpoint decides the architecture, not what runs or where): ignored",
            file=sys.stderr,
        )
    return checkpoint


def _clean(mapping: dict[str, Any], cls: type | None, setting: str, dropped: list[str], where: str, depth: int,
           seen: dict[int, Any], complete: bool) -> dict[str, Any]:
    """``mapping`` (a class's init arguments) without ``cls``'s runtime options, and every nested
    ``{"class_path", "init_args"}`` value cleaned the same way. ``seen`` maps the id of a container
    already cleaned to its result: an unpickled file may reference one object many times, and a
    walk without it is exponential in the nesting. ``complete``: the file was written by
    ``python -m app fit``, so a nested part must hold every argument of its class."""
    check_depth(depth, setting, where)
    excluded = runtime_options(cls) if cls is not None else ()
    parameters = _parameters(cls)
    cleaned = {}
    for key, value in mapping.items():
        if key in excluded:
            if setting == "model.init_args":  # the task's own: it never saves them
                dropped.append(f"{setting}.{key}")
            continue
        if isinstance(value, str) and key in parameters and not takes_text(parameters[key].annotation):
            check_text_for_class(value, f"{setting}.{key}", where)
        cleaned[key] = _clean_value(value, f"{setting}.{key}", dropped, where, depth + 1, seen, complete)
    return cleaned


def _parameters(cls: type | None) -> dict[str, Any]:
    """``cls``'s constructor parameters by name (none for an unknown class or signature)."""
    import inspect

    if cls is None:
        return {}
    try:
        return dict(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return {}


def _clean_value(value: Any, setting: str, dropped: list[str], where: str, depth: int, seen: dict[int, Any],
                 complete: bool) -> Any:
    if not isinstance(value, (dict, list, tuple)):
        return value
    if id(value) in seen:
        return seen[id(value)]
    check_depth(depth, setting, where)
    if isinstance(value, dict) and isinstance(value.get("class_path"), str):
        cls = project_class(value["class_path"], object, setting, where)
        if complete and setting.startswith("model.") and isinstance(value.get("init_args"), dict):
            check_saved_arguments(cls, value["init_args"], f"hyper_parameters{setting.removeprefix('model.init_args')}.init_args", where)
        cleaned = dict(value)
        for arguments in ("init_args", "dict_kwargs"):
            if isinstance(value.get(arguments), dict):
                cleaned[arguments] = _clean(value[arguments], cls, f"{setting}.init_args", dropped, where, depth + 1, seen, complete)
    elif isinstance(value, dict):
        cleaned = {key: _clean_value(inner, f"{setting}.{key}", dropped, where, depth + 1, seen, complete)
                   for key, inner in value.items()}
    else:
        cleaned = type(value)(_clean_value(inner, f"{setting}[{i}]", dropped, where, depth + 1, seen, complete)
                              for i, inner in enumerate(value))
    seen[id(value)] = cleaned
    return cleaned
