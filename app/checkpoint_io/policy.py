"""The checkpoint policy, in one place: **a checkpoint decides the architecture, the command line
decides the rest.**

A checkpoint names classes (from the allow-list, :mod:`app.checkpoint_io.classes`), sizes and the
head's structure. It never chooses what runs or where: a ``torch.compile`` backend and its options
(which name compilers and programs), a download switch or URL, a data, cache or output location, a
hub name. Every class whose constructor takes such an argument lists it in its ``runtime_options``
class attribute (a task's ``compile``, a datamodule's ``data_dir`` / ``download`` / ``base_url``,
the Hugging Face encoder's ``model``). Three places apply the rule:

* reading: :func:`~app.checkpoint_io.classes.drop_runtime_options` removes those keys from a checkpoint as it is read
  (:func:`app.checkpoint_io.read_checkpoint`), so no reader, command or saved ``config.yaml`` takes
  them from the file. A checkpoint written by ``python -m app fit`` holds none (tasks leave them out
  of their saved hyper-parameters); one that does was edited, and one warning line names the keys.
* ``fit|validate|test|predict --ckpt_path``: :func:`parse_with_checkpoint` builds the checkpoint's
  model (task, head, encoder, sizes) with everything else from the command line and its configs.
* the tools that rebuild a checkpoint alone (``analyze``, ``convert``, ``bench ds``): runtime
  options come from their ``--config`` files (:func:`with_runtime_options`, :func:`runtime_data_options`).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from app.checkpoint_io.classes import MAX_DEPTH, PROJECT_PACKAGES, drop_runtime_options, project_class, runtime_options  # noqa: F401
from app.checkpoint_io.reading import read_checkpoint


def read_config_files(config_files: list[str] | None) -> dict[str, Any]:
    """The user's YAML config files merged in order (later files win, mappings merged key by key),
    as a tool that rebuilds a checkpoint reads them: each checked as ``fit`` checks it
    (:func:`app.errors.read_config_file`: a regular UTF-8 file, no recursive alias, no key given
    twice), then plain data only (``yaml.safe_load``); a problem is one line naming the file."""
    import yaml

    from app.errors import read_config_file

    merged: dict[str, Any] = {}
    for path in config_files or []:
        if not os.path.exists(path):
            raise ValueError(f"config file {path} does not exist (check the --config path)")
        text = read_config_file(path)
        try:
            config = yaml.safe_load(text) or {}
        except yaml.YAMLError as error:
            reason = " ".join(str(error).split())[:160]
            raise ValueError(f"config file {path} is not a readable YAML file ({reason}): fix the file") from None
        if not isinstance(config, dict):
            raise ValueError(f"config file {path} holds a {type(config).__name__}, not a mapping of sections (model, data, trainer)")
        try:
            _merge(merged, config, 0)
        except RecursionError:
            raise ValueError(f"config file {path} nests deeper than {MAX_DEPTH} levels: fix the file") from None
    return merged


def _merge(into: dict[str, Any], update: dict[str, Any], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise RecursionError
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, depth + 1)
        else:
            _check_depth(value, depth + 1)
            into[key] = value


def _check_depth(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise RecursionError
    if isinstance(value, dict):
        for inner in value.values():
            _check_depth(inner, depth + 1)
    elif isinstance(value, list):
        for inner in value:
            _check_depth(inner, depth + 1)


def with_runtime_options(saved: dict[str, Any], cls: type, given: Any) -> dict[str, Any]:
    """The checkpoint's init arguments ``saved`` of ``cls`` with the runtime options the user's
    configuration ``given`` (the same class's ``init_args``) sets, nested classes included where
    the user's configuration names the same class at the same place. Everything else stays the
    checkpoint's: the architecture is the checkpoint's, the runtime the user's."""
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


# ---------------------------------------------------------------------- the CLI: fit/validate/test/predict --ckpt_path
def parse_with_checkpoint(parser: Any, argv: list[str], before_resolve: Callable[[Any], None]) -> Any:
    """The parsed configuration of ``argv``; with ``--ckpt_path`` the checkpoint's model
    architecture (its task, head, encoder and sizes) replaces the config files' model settings.

    ``test --config configs/lm/synthetic.yaml --ckpt_path <MoS run>/last.ckpt`` builds the
    checkpoint's MoS model, not the config's softmax. Mechanism: jsonargparse applies arguments in
    order, so the arguments are parsed again with the checkpoint's model configuration placed
    after the config files and other options given before ``--ckpt_path`` and before the model
    options (``--model...``) found there. Model options written on the command line (wherever
    they stand) and everything after ``--ckpt_path`` win, in their order: ``fit --ckpt_path last
    --model.init_args.head.init_args.group_lasso_weight 0.001`` resumes with the new value
    (Lightning's own merge, ``LightningCLI._parse_ckpt_path``, puts the checkpoint over everything:
    Lightning-AI/pytorch-lightning#21455). Asking for another class than the checkpoint's (a
    head, an encoder) is one line naming both (:func:`checkpoint_class_conflict`). The file is
    read once (:func:`checkpoint_model_config` hands it to the Trainer's restore).

    ``before_resolve(config)`` is called on each parse before ``--ckpt_path last`` is resolved to
    a file (the CLI records the logger settings as written)."""
    from jsonargparse import ArgumentError

    from app.runtime.directories import resolve_resume

    # --print_config prints at the end of a parse and exits: the parses that only find the
    # checkpoint leave it out, so what is printed is the model the command would build.
    printing, quiet = print_config_split(argv)
    refused: ArgumentError | None = None
    try:
        config = parser.parse_args(quiet if printing else argv)
    except ArgumentError as error:
        # A model option only the checkpoint's classes take (a MoS head's option while the
        # config names a softmax): find the checkpoint without the model options, then parse
        # everything again with its model below.
        if not literal_ckpt_path(argv):
            raise
        refused = error
        config = parser.parse_args(without_model_options(quiet))
    subcommand = config.get("subcommand")
    before_resolve(config)
    hparams = None
    if subcommand and config[subcommand].get("ckpt_path"):
        if not (printing and config[subcommand].ckpt_path == "best"):  # --print_config runs nothing: no refusal
            resolve_resume(config[subcommand], subcommand)
        configured = config[subcommand].get("model")
        configured = configured.get("class_path") if configured else None
        hparams = checkpoint_model_config(config[subcommand].ckpt_path, configured)
    if not hparams:
        if refused is not None:  # no model in a checkpoint: the options were wrong after all
            raise refused
        if printing:
            parser.parse_args(quiet + printing)  # prints the configuration and exits
        return config
    ckpt_path = config[subcommand].ckpt_path
    saved = {"class_path": hparams.get("class_path", configured), "init_args": hparams.get("dict_kwargs", hparams)}
    try:
        config = parser.parse_args(with_checkpoint_model(quiet, saved, str(ckpt_path)) + printing)  # printing: prints, exits
    except ArgumentError as error:
        refuse_unparsable_model(parser, quiet, saved, str(ckpt_path), error)
        raise
    before_resolve(config)
    resolve_resume(config[subcommand], subcommand)
    checkpoint_class_conflict(ckpt_path, saved, config[subcommand].model)
    return config


def refuse_unparsable_model(parser: Any, argv: list[str], saved: dict[str, Any], ckpt_path: str, error: Exception) -> None:
    """Refuse, in one line naming the file, a checkpoint whose own model configuration does not
    parse (an edited hyper-parameter: a size given as text); when it parses without the command
    line's model options, the error is the user's and is left to the caller."""
    from jsonargparse import ArgumentError

    from tasks.checkpoint_fit import FIX
    from app.errors import argument_error_line

    try:
        parser.parse_args(with_checkpoint_model(without_model_options(argv), saved, ckpt_path))
    except ArgumentError:
        reason = argument_error_line(str(error))
        raise ValueError(f"checkpoint {ckpt_path}: its hyper_parameters do not build its model ({reason}); {FIX}") from None


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
    checkpoint = read_checkpoint(text, hand_over=True)  # the Trainer's restore takes it: one read per command
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


#: Model arguments whose class the state dict does not depend on (a resumed run may change them).
UNWEIGHTED_ARGUMENTS = ("optimizer", "lr_scheduler")


def checkpoint_class_conflict(ckpt_path: Any, hparams: dict[str, Any], model: Any) -> None:
    """Refuse, with one line naming both, a model configuration that asks for another class than
    the checkpoint holds at the same argument (``model.init_args.head``, ``...encoder``, nested
    ones): its weights cannot fit. ``hparams`` is :func:`checkpoint_model_config`'s answer and
    ``model`` the configuration the user's explicit settings give (a ``Namespace``); a head may be
    a short name (``mos``) on either side. Optimizer and scheduler classes may change."""
    def walk(saved: Any, given: Any, key: str) -> None:
        saved_class, given_class = class_named(saved, key), class_named(given, key)
        if saved_class and given_class and saved_class != given_class:
            held, setting = (f"a {saved_class} head", "the heads/*.yaml") if key == "model.init_args.head" else (f"{key} {saved_class}", "the")
            raise ValueError(
                f"checkpoint {ckpt_path} holds {held} but the model builds {given_class}: drop --{key} (or {setting} config "
                f"given after --ckpt_path that sets it) to use the checkpoint's {saved_class}"
            )
        if not (isinstance(saved, dict) and hasattr(given, "get")):
            return
        nested = "class_path" in saved
        inner_saved = saved.get("init_args", saved.get("dict_kwargs")) if nested else saved
        inner_given = given.get("init_args") if nested else given
        if not (isinstance(inner_saved, dict) and hasattr(inner_given, "get")):
            return
        prefix = f"{key}.init_args" if nested else key
        for name, value in inner_saved.items():
            if name not in UNWEIGHTED_ARGUMENTS:
                walk(value, inner_given.get(name), f"{prefix}.{name}")

    walk(hparams, model, "model")


def class_named(value: Any, key: str) -> str | None:
    """The class a configuration value names, as ``module.Class`` of its definition: its
    ``class_path`` (a class of the project's packages), or for a head given as a string (``mos``,
    ``heads.Mixtape``) the registered class; ``None`` otherwise."""
    from heads.registry import head_class

    if hasattr(value, "get") and isinstance(value.get("class_path"), str):
        name = value.get("class_path")
        module_name, _, attr = name.rpartition(".")
        if module_name.split(".")[0] not in PROJECT_PACKAGES:
            return name
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError):
            return name
        return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else name
    if isinstance(value, str) and key.rpartition(".")[2] == "head":
        try:
            cls = head_class(value)
        except ValueError:
            return None  # an unknown name: the head's own check reports it
        return f"{cls.__module__}.{cls.__qualname__}"
    return None


def option_spans(argv: list[str]) -> list[tuple[int, int]]:
    """``(start, end)`` of each ``--option value`` or ``--option=value`` in ``argv`` (the
    subcommand and bare words are spans of their own)."""
    spans, position = [], 0
    while position < len(argv):
        arg = argv[position]
        takes_value = arg.startswith("-") and "=" not in arg and arg not in ("-h", "--help") and position + 1 < len(argv)
        end = position + (2 if takes_value and not argv[position + 1].startswith("--") else 1)
        spans.append((position, end))
        position = end
    return spans


def is_model_option(arg: str) -> bool:
    return arg == "--model" or arg.startswith(("--model.", "--model="))


def is_ckpt_path_option(arg: str) -> bool:
    return arg == "--ckpt_path" or arg.startswith("--ckpt_path=")


def literal_ckpt_path(argv: list[str]) -> str | None:
    """The checkpoint file named on the command line (``None`` for none or ``last``/``best``)."""
    for start, end in reversed(option_spans(argv)):
        if is_ckpt_path_option(argv[start]):
            value = argv[start].partition("=")[2] if "=" in argv[start] else argv[end - 1]
            return value if value not in ("last", "best", "hpc") and Path(value).is_file() else None
    return None


def print_config_split(argv: list[str]) -> tuple[list[str], list[str]]:
    """The words of ``argv`` that ask for ``--print_config`` (``--print_config`` or
    ``--print_config=FLAGS``; empty if none), and ``argv`` without them."""
    printing = [arg for arg in argv if arg == "--print_config" or arg.startswith("--print_config=")]
    return printing, [arg for arg in argv if arg not in printing]


def without_model_options(argv: list[str]) -> list[str]:
    return [arg for start, end in option_spans(argv) if not is_model_option(argv[start]) for arg in argv[start:end]]


def with_checkpoint_model(argv: list[str], model: dict[str, Any], ckpt_path: str) -> list[str]:
    """``argv`` with the checkpoint's ``model`` configuration after what stands before
    ``--ckpt_path`` (except the model options there, moved after it) and ``--ckpt_path`` set to the
    file it resolved to; everything from ``--ckpt_path`` on follows unchanged. Without
    ``--ckpt_path`` on the command line (it came from a config file) the model goes after all
    config files and other options."""
    spans = option_spans(argv)
    flag = next((i for i in range(len(spans) - 1, -1, -1) if is_ckpt_path_option(argv[spans[i][0]])), len(spans))
    before = [argv[a:b] for a, b in spans[:flag]]
    others = [arg for span in before if not is_model_option(span[0]) for arg in span]
    model_options = [arg for span in before if is_model_option(span[0]) for arg in span]
    after = [arg for a, b in spans[flag + 1:] for arg in argv[a:b]]
    resolved = ["--ckpt_path", ckpt_path] if flag < len(spans) else []
    return [*others, "--model", json.dumps(model), *model_options, *resolved, *after]
