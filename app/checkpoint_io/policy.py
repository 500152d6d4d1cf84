"""The checkpoint policy, in one place: **a checkpoint decides the architecture, the command line
decides the rest.**

A checkpoint names classes (from the allow-list, :mod:`app.checkpoint_io.classes`), sizes and the
head's structure. It never chooses what runs or where: a ``torch.compile`` backend and its options
(which name compilers and programs), a download switch or URL, a data, cache or output location, a
hub name. Every class whose constructor takes such an argument lists it in its ``runtime_options``
class attribute (a task's ``compile``, a datamodule's ``data_dir`` / ``download`` / ``base_url``,
the Hugging Face encoder's ``model``); :func:`drop_runtime_options` removes those keys from what a
checkpoint holds as it is read (:func:`app.checkpoint_io.read_checkpoint`), so no reader, command
or saved ``config.yaml`` can take them from the file. A checkpoint written by ``python -m app fit``
holds none of them (tasks leave them out of their saved hyper-parameters); one that does was
edited, and each key it carried is named in one warning line.
"""

from __future__ import annotations

import sys
from typing import Any

#: How deep a checkpoint's hyper-parameters may nest (a project config is a few levels deep);
#: deeper is refused as damaged instead of walked.
MAX_DEPTH = 32


def runtime_options(cls: type) -> tuple[str, ...]:
    """The constructor arguments of ``cls`` that only the command line may set."""
    return tuple(getattr(cls, "runtime_options", ()))


def drop_runtime_options(checkpoint: dict[str, Any], where: str) -> dict[str, Any]:
    """``checkpoint`` without any runtime option in its model or datamodule hyper-parameters
    (nested ``class_path`` / ``init_args`` parts such as an encoder included); one warning line on
    stderr names the keys it dropped. Class paths must already have passed
    :func:`~app.checkpoint_io.classes.check_class_paths`."""
    import lightning.pytorch as pl

    from app.checkpoint_io.classes import project_class

    dropped: list[str] = []
    hparams = checkpoint.get("hyper_parameters")
    model_path = (hparams or {}).get("_class_path") or (checkpoint.get("headbench") or {}).get("task")
    if isinstance(hparams, dict):
        model_class = project_class(model_path, pl.LightningModule, "the model class", where) if model_path else None
        checkpoint["hyper_parameters"] = _clean(hparams, model_class, "model.init_args", dropped, where, 0, {})
    data = checkpoint.get("datamodule_hyper_parameters")
    data_path = checkpoint.get("datamodule_class_path") or (data or {}).get("_class_path")
    if isinstance(data, dict):
        data_class = project_class(data_path, pl.LightningDataModule, "the datamodule class", where) if data_path else None
        checkpoint["datamodule_hyper_parameters"] = _clean(data, data_class, "data.init_args", dropped, where, 0, {})
    if dropped:
        print(
            f"warning: checkpoint {where} sets {', '.join(dropped)}, which only the command line or its config files may "
            f"set (a checkpoint decides the architecture, not what runs or where): ignored",
            file=sys.stderr,
        )
    return checkpoint


def _clean(mapping: dict[str, Any], cls: type | None, setting: str, dropped: list[str], where: str, depth: int,
           seen: dict[int, Any]) -> dict[str, Any]:
    """``mapping`` (a class's init arguments) without ``cls``'s runtime options, and every nested
    ``{"class_path", "init_args"}`` value cleaned the same way. ``seen`` maps the id of a container
    already cleaned to its result: an unpickled file may reference one object many times, and a
    walk without it is exponential in the nesting."""
    check_depth(depth, setting, where)
    excluded = runtime_options(cls) if cls is not None else ()
    cleaned = {}
    for key, value in mapping.items():
        if key in excluded:
            dropped.append(f"{setting}.{key}")
            continue
        cleaned[key] = _clean_value(value, f"{setting}.{key}", dropped, where, depth + 1, seen)
    return cleaned


def _clean_value(value: Any, setting: str, dropped: list[str], where: str, depth: int, seen: dict[int, Any]) -> Any:
    if not isinstance(value, (dict, list, tuple)):
        return value
    if id(value) in seen:
        return seen[id(value)]
    check_depth(depth, setting, where)
    if isinstance(value, dict) and isinstance(value.get("class_path"), str):
        from app.checkpoint_io.classes import project_class

        cls = project_class(value["class_path"], object, setting, where)
        cleaned = dict(value)
        for arguments in ("init_args", "dict_kwargs"):
            if isinstance(value.get(arguments), dict):
                cleaned[arguments] = _clean(value[arguments], cls, f"{setting}.init_args", dropped, where, depth + 1, seen)
    elif isinstance(value, dict):
        cleaned = {key: _clean_value(inner, f"{setting}.{key}", dropped, where, depth + 1, seen) for key, inner in value.items()}
    else:
        cleaned = type(value)(_clean_value(inner, f"{setting}[{i}]", dropped, where, depth + 1, seen) for i, inner in enumerate(value))
    seen[id(value)] = cleaned
    return cleaned


def check_depth(depth: int, setting: str, where: str) -> None:
    """Refuse hyper-parameters nested deeper than :data:`MAX_DEPTH` (also a cycle), naming where."""
    if depth > MAX_DEPTH:
        raise ValueError(
            f"checkpoint {where} has hyper-parameters nested deeper than {MAX_DEPTH} levels (at {setting[:80]}…): "
            f"it is damaged or was edited; use a checkpoint written by python -m app fit"
        )


def read_config_files(config_files: list[str] | None) -> dict[str, Any]:
    """The user's YAML config files merged in order (later files win, mappings merged key by key),
    as a tool that rebuilds a checkpoint reads them: plain data only (``yaml.safe_load``), a
    recursive alias or a non-regular file refused in one line."""
    import os

    import yaml

    merged: dict[str, Any] = {}
    for path in config_files or []:
        if not os.path.isfile(path):
            what = "does not exist" if not os.path.exists(path) else "is not a regular file"
            raise ValueError(f"--config {path} {what}: pass a YAML config file such as configs/lm/ptb.yaml")
        try:
            with open(path, encoding="utf-8") as handle:
                config = yaml.safe_load(handle) or {}
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as error:
            reason = " ".join(str(error).split())[:160]
            raise ValueError(f"--config {path} is not a readable YAML file ({reason}): fix the file") from None
        if not isinstance(config, dict):
            raise ValueError(f"--config {path} holds a {type(config).__name__}, not a mapping of sections (model, data, trainer)")
        try:
            _merge(merged, config, 0)
        except RecursionError:
            raise ValueError(f"--config {path} nests deeper than {MAX_DEPTH} levels (a recursive alias?): fix the file") from None
    return merged


def _merge(into: dict[str, Any], update: dict[str, Any], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise RecursionError
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, depth + 1)
        else:
            check_plain(value, depth + 1)
            into[key] = value


def check_plain(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise RecursionError
    if isinstance(value, dict):
        for inner in value.values():
            check_plain(inner, depth + 1)
    elif isinstance(value, list):
        for inner in value:
            check_plain(inner, depth + 1)


def with_runtime_options(saved: dict[str, Any], cls: type, given: Any) -> dict[str, Any]:
    """The checkpoint's init arguments ``saved`` of ``cls`` with the runtime options the user's
    configuration ``given`` (the same class's ``init_args``) sets, nested classes included where
    the user's configuration names the same class at the same place. Everything else stays the
    checkpoint's: the architecture is the checkpoint's, the runtime the user's."""
    from app.checkpoint_io.classes import project_class

    if not isinstance(given, dict):
        return saved
    merged = dict(saved)
    for key in runtime_options(cls):
        if key in given:
            merged[key] = given[key]
    for key, value in saved.items():
        inner = given.get(key)
        if (isinstance(value, dict) and isinstance(value.get("class_path"), str) and isinstance(inner, dict)
                and same_name(inner.get("class_path"), value["class_path"])):
            inner_class = project_class(value["class_path"], object, key, "the checkpoint")
            arguments = "init_args" if "init_args" in value else "dict_kwargs"
            merged[key] = {**value, arguments: with_runtime_options(value.get(arguments) or {}, inner_class, inner.get("init_args"))}
    return merged


def same_name(given: Any, saved: str) -> bool:
    """Whether a config's ``class_path`` (short, ``datamodules.TextCorpus``, or full) names the
    checkpoint's class: compared by class name, the module path being free to be a package's."""
    return isinstance(given, str) and given.rpartition(".")[2] == saved.rpartition(".")[2]


def runtime_data_options(config_files: list[str] | None, data_class: type, where: str) -> dict[str, Any]:
    """The runtime options of ``data_class`` (its data, cache and download settings) that the
    user's config files give in their ``data`` section (``--config configs/lm/ptb.yaml`` of a tool
    that rebuilds a checkpoint's datamodule). A file whose data section names another class than
    the checkpoint's is refused in one line. Its architecture options (the vocabulary's source,
    sizes) are the checkpoint's and are not read from the file."""
    data = read_config_files(config_files).get("data")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config has a data section of type {type(data).__name__}: expected class_path and init_args")
    named = data.get("class_path")
    if named is not None and not same_name(named, data_class.__name__):
        raise ValueError(
            f"--config configures data {named}, but checkpoint {where} was trained on {data_class.__name__}: "
            f"pass a config of the checkpoint's data"
        )
    given = data.get("init_args") or {}
    return {key: given[key] for key in runtime_options(data_class) if isinstance(given, dict) and key in given}
