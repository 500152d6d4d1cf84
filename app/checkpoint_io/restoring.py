"""Models and data rebuilt from a checkpoint file alone: the one way the tools (``analyze``,
``convert``, ``bench``) restore a checkpoint."""

from __future__ import annotations

import re
from typing import Any

from app.checkpoint_io.classes import project_class
from app.checkpoint_io.policy import runtime_data_options, same_name, with_runtime_options
from app.checkpoint_io.reading import read_checkpoint
from datamodules.files import RefusedInput
from tasks.checkpoint_fit import FIX, check_fits_model


def restore(
    path: str, checkpoint: dict[str, Any] | None = None, default_task: str | type | None = None, data: bool = True,
    config: list[str] | None = None,
) -> tuple[Any, Any | None]:
    """The model (with its weights) and the datamodule a checkpoint describes, rebuilt from the
    checkpoint alone: the one way the tools (``analyze``, ``convert``, ``bench``) restore a
    checkpoint. (``--ckpt_path`` of fit/validate/test/predict is the Trainer's own restore, through
    the same reader.)

    ``path`` is read through :func:`read_checkpoint` unless the caller passes the ``checkpoint`` it
    has already read (``path`` then only names it in error lines). ``default_task`` (a class or class path) is
    the model class of checkpoints that name none. With ``data`` the datamodule is rebuilt from
    ``datamodule_class_path`` and its hyper-parameters and the checkpoint's data fingerprint is
    compared with it; without, the datamodule returned is ``None``. What runs and where (where the
    data lives, whether it may be downloaded, an encoder's hub name or directory) is never the
    checkpoint's choice: those options come from the user's ``config`` files (YAML as given to
    ``fit``; :func:`.policy.runtime_data_options`, :func:`.policy.with_runtime_options`).
    """
    import lightning.pytorch as pl

    checkpoint = read_checkpoint(path) if checkpoint is None else checkpoint
    datamodule = None
    if data:
        data_path = checkpoint.get("datamodule_class_path")
        if data_path is None:
            raise ValueError(f"checkpoint {path} has no datamodule_class_path: write it with a HeadTask run (python -m app fit)")
        from datamodules.base import HeadDataModule

        data_class = project_class(data_path, HeadDataModule, "the datamodule class", path)
        data_hparams = {k: v for k, v in (checkpoint.get("datamodule_hyper_parameters") or {}).items() if not k.startswith("_")}
        options = runtime_data_options(config, data_class, path)
        seed = data_hparams.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"checkpoint {path}: datamodule_hyper_parameters.seed must be an integer, got {seed!r}; {FIX}")
        try:
            datamodule = data_class(**data_hparams, **options)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as error:  # an edited setting: one line
            raise ValueError(f"checkpoint {path}: its datamodule_hyper_parameters do not build {data_class.__name__} "
                             f"({' '.join(str(error).split())[:200]}); {FIX}") from None
    class_path = (checkpoint.get("hyper_parameters") or {}).get("_class_path") or (checkpoint.get("headbench") or {}).get("task")
    if class_path is None and default_task is None:
        raise ValueError(f"checkpoint {path} names no model class (no hyper_parameters._class_path): write it with python -m app fit")
    if class_path is None and not isinstance(default_task, type):
        default_task = project_class(default_task, pl.LightningModule, "the model class", path)
    model_class = project_class(class_path, pl.LightningModule, "the model class", path) if class_path else default_task
    if config:
        from app.checkpoint_io.policy import read_config_files

        given = read_config_files(config).get("model") or {}
        named = given.get("class_path") if isinstance(given, dict) else None
        if named is not None and not same_name(named, model_class.__name__):
            raise ValueError(f"--config configures model {named}, but checkpoint {path} holds a {model_class.__name__}: pass a config of its task")
        hparams = with_runtime_options(dict(checkpoint.get("hyper_parameters") or {}), model_class,
                                       given.get("init_args") if isinstance(given, dict) else None)
        checkpoint = {**checkpoint, "hyper_parameters": hparams}
    return build_model(checkpoint, path, model_class, datamodule), datamodule


def build_model(checkpoint: dict[str, Any], where: str, model_class: type, datamodule: Any | None = None) -> Any:
    """What ``LightningModule.load_from_checkpoint`` does, on the dictionary already read: the
    hyper-parameters that are ``__init__`` arguments are passed to Lightning's own instantiator
    (which turns ``class_path`` / ``init_args`` parts such as the head into objects), then
    ``on_load_checkpoint`` (head structure, origin checks) and the state dict. The checkpoint's
    task, head and data fingerprint are compared with the model and ``datamodule`` first
    (:func:`datamodules.fingerprint.origin_mismatch`), naming ``where``. Called by :func:`restore`."""
    import inspect

    from jsonargparse import ArgumentError
    from lightning.pytorch.cli import instantiate_module

    from datamodules.fingerprint import checkpoint_origin, origin_mismatch

    hparams = dict(checkpoint.get("hyper_parameters") or {})
    saved = checkpoint.get("headbench")
    if saved is not None:  # another task's checkpoint: say so before its hyper-parameters fail to fit
        problem = origin_mismatch({"task": saved.get("task")}, {"task": f"{model_class.__module__}.{model_class.__qualname__}"})
        if problem:
            raise ValueError(f"checkpoint {where} {problem}")
    parameters = inspect.signature(model_class.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    kwargs = {k: v for k, v in hparams.items() if not k.startswith("_") and (takes_any or k in parameters)}
    try:
        if hparams.get("_instantiator") is not None:
            model = instantiate_module(model_class, kwargs)
        else:
            model = model_class(**kwargs)
    except (ArgumentError, TypeError, ValueError, AttributeError, KeyError, IndexError) as error:
        # An edited hyper-parameter (a size as text, a dropout of 7, a missing argument): the
        # constructor's or parser's own words, on one line, after the file's name; a nested key
        # the parser refuses (an encoder option its class does not take) named as such.
        if isinstance(error, ArgumentError):
            refused_key(error, where)
        cause: BaseException | None = error
        while cause is not None:  # a file the user named (a Hugging Face model) is theirs, not the checkpoint's
            if isinstance(cause, RefusedInput):
                raise cause.with_traceback(None) from None
            cause = cause.__cause__ or cause.__context__
        reason = " ".join(str(error).split())
        reason = reason[:200] + ("…" if len(reason) > 200 else "")
        raise ValueError(f"checkpoint {where}: its hyper_parameters do not build {model_class.__name__} ({reason}); {FIX}") from None
    model.restored_from = where
    if saved is not None:
        adopts = getattr(model, "adopts_checkpoint_vocabulary", False)
        problem = origin_mismatch(saved, checkpoint_origin(model, None if adopts else datamodule))
        if problem:
            raise ValueError(f"checkpoint {where} {problem}")
    model.on_load_checkpoint(checkpoint)
    check_fits_model(checkpoint, model, where)  # HeadTask's hook checks too; other models need it here
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


def refused_key(error: Exception, where: str) -> None:
    """Raise the one line for a nested hyper-parameter the parser does not accept (Lightning's
    instantiator parses the hyper-parameters as the ``module`` of a parser of its own; in the
    application's configuration they are ``model.init_args``); return for any other parse error."""
    from app.errors import argument_error_line

    line = argument_error_line(str(error).replace('Parser key "module.', 'Parser key "model.init_args.'))
    refused = re.match(r"(\S+) (\S+): Option '([^']+)' is not accepted", line)
    if refused:
        key, owner, option = refused.groups()
        raise ValueError(
            f"checkpoint {where} has the hyper-parameter {option!r} under {key}, which {owner} does not take: "
            f"it was edited or written by another version of the project (use a checkpoint written by python -m app fit)"
        ) from None
