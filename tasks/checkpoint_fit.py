"""Whether a checkpoint fits the model and Trainer it is restored into: :func:`check_fits_model`
(weights' dtypes and shapes, tied weights, optimizer moments) and :func:`check_fits_trainer` (the
loops' state), run by :meth:`tasks.base.HeadTask.on_load_checkpoint` before Lightning loads
anything; :func:`check_scheduler_states` (the LR schedulers' saved states against the schedulers
the run built), run by :meth:`tasks.base.HeadTask.on_fit_start` before Lightning restores them;
:func:`check_param_groups` (the restored optimizer groups). The reader's checks of the file itself
are :mod:`app.checkpoint_io.structure`.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections import Counter
from typing import Any

import torch

from datamodules.files import CHECKPOINT_FIX as FIX


def found(value: Any) -> str:
    """How an entry's value is named in an error line: its type, and a short value."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    shown = " ".join(repr(value).split())
    return f"{type(value).__name__} {shown[:40]}{'…' if len(shown) > 40 else ''}"


def refused(where: str, entry: str, rule: str, value: Any) -> ValueError:
    """The one line of a refused entry: the file, the entry, the rule it breaks and the fix."""
    return ValueError(f"checkpoint {where}: {entry} must be {rule}, got {found(value)}; {FIX}")


def expect(condition: bool, where: str, entry: str, rule: str, value: Any) -> None:
    """Refuse ``value`` at ``entry`` unless ``condition`` holds (:func:`refused`)."""
    if not condition:
        raise refused(where, entry, rule, value)


def natural(value: Any) -> bool:
    """Whether ``value`` is a count: an integer (not a boolean) >= 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ---------------------------------------------------------------------- the reader's check
#: The dtype a Trainer's ``precision`` converts a model to after restoring it (its checkpoints hold that dtype).
TRUE_PRECISION = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


def check_fits_model(checkpoint: dict[str, Any], model: torch.nn.Module, where: str, precision: str | None = None) -> None:
    """Refuse a state dict entry whose dtype or shape differs from the model's (``load_state_dict``
    would cast an ``int8`` or ``bfloat16`` weight silently), different values for parameters the
    model ties (one would silently win), and optimizer state of another shape than its parameter
    (Adam would fail only once training has started). Called after the model's structure is
    taken from the checkpoint (a DS-Softmax head's experts) and before its weights are loaded.
    ``precision``: the restoring Trainer's; a ``*-true`` precision converts the model after the
    restore, so its floating-point weights may be saved in that dtype."""
    saved = checkpoint["state_dict"]
    converted = TRUE_PRECISION.get(str(precision))
    mine = model.state_dict(keep_vars=True)
    for name, value in saved.items():
        target = mine.get(name)
        if target is None:
            continue  # an unexpected key: load_state_dict's strict check names it
        if value.dtype != target.dtype and not (value.dtype == converted and target.is_floating_point()):
            raise ValueError(
                f"checkpoint {where}: state_dict.{name} is a {str(value.dtype).removeprefix('torch.')} tensor but the model's "
                f"is {str(target.dtype).removeprefix('torch.')} (it would be cast without a word; a run trained with "
                f"--trainer.precision bf16-true or 16-true is resumed and evaluated with the same option); {FIX}"
            )
        if value.shape != target.shape:
            built = "hyper_parameters and head_structure" if "head_structure" in checkpoint else "hyper_parameters"
            raise ValueError(
                f"checkpoint {where}: state_dict.{name} has shape {tuple(value.shape)} but the model built from its {built} has "
                f"{tuple(target.shape)}: a model option given on the command line (or in a config after --ckpt_path) sets "
                f"another size than the checkpoint's, so drop it; without one, its structure does not match its weights: {FIX}"
            )
    first_name: dict[int, str] = {}
    for name, target in mine.items():
        if name not in saved or target.numel() == 0:
            continue
        other = first_name.setdefault(target.data_ptr(), name)
        if other != name and other in saved and not torch.equal(saved[other], saved[name]):
            raise ValueError(
                f"checkpoint {where}: state_dict.{name} and state_dict.{other} differ, but the model ties them (one "
                f"parameter; tie_weights) and one would silently replace the other; {FIX}"
            )
    parameters = [p for _, p in model.named_parameters()]
    for index, state in enumerate(checkpoint.get("optimizer_states") or []):
        groups = state["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(parameters):
            continue  # not the one-group layout of configure_optimizers: the optimizer compares group sizes itself
        for number, values in state["state"].items():
            parameter = parameters[groups[0]["params"].index(number)]
            for key, value in values.items():
                entry = f"optimizer_states[{index}].state[{number}].{key}"
                if key == "step":  # torch writes a one-value float tensor; an optimizer adds 1 to it in place
                    expect(natural(value) or isinstance(value, float) or isinstance(value, torch.Tensor) and value.numel() == 1
                           and value.is_floating_point(), where, entry, "a count: a number or a one-value float tensor", value)
                elif key in PARAMETER_SHAPED and not (key == "momentum_buffer" and value is None) and not (
                        isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == parameter.shape):
                    raise ValueError(
                        f"checkpoint {where}: {entry} must be a floating-point tensor of its parameter's shape "
                        f"{tuple(parameter.shape)}, got {found(value)}; {FIX}"
                    )


#: Optimizer state that torch's optimizers keep per element of a parameter (Adam's moments,
#: SGD's momentum, ...): a tensor of the parameter's shape.
PARAMETER_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "momentum_buffer", "square_avg", "grad_avg",
                    "acc_delta", "sum", "ax", "prev", "step_size", "mu_product")


def check_fits_trainer(checkpoint: dict[str, Any], trainer: Any, where: str) -> None:
    """The loops' state against the Trainer's own loops, before Lightning restores them: every
    entry a loop reads back is present, a dictionary where the loop has one and a counter (an
    integer >= 0) or a flag where it has one (Lightning's loops read them without a check). A
    resumed ``fit`` needs the optimizer and scheduler states too."""
    missing = [key for key in ("optimizer_states", "lr_schedulers") if key not in checkpoint]
    if missing and trainer.state.fn == "fit":
        raise ValueError(
            f"checkpoint {where} has no {' and no '.join(missing)} (it holds the model only: written with save_weights_only, "
            f"or edited), and fit --ckpt_path resumes a run's training from them: evaluate it with test or validate, or resume "
            f"from the run's last.ckpt"
        )
    loops = checkpoint.get("loops")
    if loops is None:
        return
    for name in ("fit_loop", "validate_loop", "test_loop", "predict_loop"):
        loop = getattr(trainer, name, None)
        if loop is not None:
            same_layout(loop.state_dict(), loops.get(name), where, f"loops.{name}")


def check_param_groups(trainer: Any, where: str) -> None:
    """Every optimizer parameter group restored from a checkpoint has each setting the optimizer
    keeps per group (``optimizer.defaults``: Adam's ``betas``, ``eps``, ...), of the same kind as
    the default: ``load_state_dict`` takes the saved groups as they are, and the optimizer would
    fail at its first step with a ``KeyError``. Called when training starts, after the restore."""
    for index, optimizer in enumerate(getattr(trainer, "optimizers", None) or []):
        for number, group in enumerate(optimizer.param_groups):
            for key, value in optimizer.defaults.items():
                entry = f"optimizer_states[{index}].param_groups[{number}].{key}"
                if key not in group:
                    raise ValueError(
                        f"checkpoint {where}: {entry} is missing ({type(optimizer).__name__} reads it at every step; a run "
                        f"with another optimizer, or edited); resume with the run's optimizer settings, or {FIX}")
                saved = group[key]
                if isinstance(value, bool) or value is None:
                    expect(isinstance(saved, bool) or saved is None, where, entry, "true, false or null", saved)
                elif isinstance(value, (int, float)):
                    expect(isinstance(saved, (int, float, torch.Tensor)) and not isinstance(saved, bool), where, entry,
                           "a number", saved)
                elif isinstance(value, (tuple, list)):
                    expect(isinstance(saved, (tuple, list)) and len(saved) == len(value)
                           and all(isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool) for v in saved),
                           where, entry, f"a list of {len(value)} numbers", saved)
            # the optimizer's own constructor checks the ranges (Adam: 0 <= beta < 1, eps >= 0, ...); it
            # takes only some of its defaults as arguments (AdamW sets decoupled_weight_decay itself)
            accepted = inspect.signature(type(optimizer).__init__).parameters
            settings = {key: group[key] for key in optimizer.defaults if key in accepted}
            try:
                type(optimizer)([torch.zeros(1, requires_grad=True)], **settings)
            except (ValueError, TypeError, RuntimeError) as error:
                raise ValueError(
                    f"checkpoint {where}: optimizer_states[{index}].param_groups[{number}] is refused by "
                    f"{type(optimizer).__name__}: {str(error).splitlines()[0] if str(error) else type(error).__name__} "
                    f"(edited, or another optimizer's); resume with the run's optimizer settings, or {FIX}") from None


def same_layout(mine: Any, saved: Any, where: str, entry: str) -> None:
    """``saved`` has every key of ``mine``, with a dictionary, flag or counter where ``mine`` has one."""
    if isinstance(mine, dict):
        expect(isinstance(saved, dict), where, entry, "a dictionary (as Lightning's loop has it)", saved)
        for key, value in mine.items():
            if key not in saved:
                raise ValueError(f"checkpoint {where}: {entry}.{key} is missing (Lightning's loop reads it); {FIX}")
            same_layout(value, saved[key], where, f"{entry}.{key}")
    elif isinstance(mine, bool):
        expect(isinstance(saved, bool), where, entry, "true or false", saved)
    elif isinstance(mine, int):
        expect(natural(saved), where, entry, "an integer >= 0", saved)


# ---------------------------------------------------------------------- LR schedulers
#: What every refusal of a saved scheduler state tells the user to do (the weights are not at fault).
SCHEDULER_FIX = ("resume with the run's lr_scheduler settings; if those are the run's, the file is damaged or was "
                 "edited: evaluate it with python -m app test, or start a new fit without --ckpt_path")

#: Scheduler entries that count epochs or steps (an integer >= 0; torch reads them without a check).
SCHEDULER_COUNTERS = ("last_epoch", "_step_count", "patience", "cooldown", "cooldown_counter", "num_bad_epochs",
                      "total_iters", "T_i", "T_mult")
#: Scheduler entries that are periods (an integer >= 1: torch divides by them at a step, unchecked).
SCHEDULER_PERIODS = ("step_size", "T_max", "T_0", "warmup_steps", "total_steps")
#: Scheduler entries that are learning rates, factors or tolerances (>= 0: a negative one turns the
#: learning rate negative or the plateau test around, and torch's schedulers do not check it).
SCHEDULER_NON_NEGATIVE = ("base_lrs", "_last_lr", "min_lrs", "default_min_lr", "eta_min", "eps", "threshold", "factor",
                          "gamma")
#: Constructor arguments a scheduler keeps under another name (ReduceLROnPlateau's ``min_lr``).
SAVED_AS = {"min_lr": "min_lrs"}
#: Constructor arguments that are not settings: a throwaway scheduler starts at the beginning.
NOT_SETTINGS = ("self", "optimizer", "last_epoch", "verbose")


def check_scheduler_states(trainer: Any, saved: Any, where: str) -> None:
    """Each LR scheduler state of a checkpoint against the scheduler the configured run built
    (``trainer.lr_scheduler_configs``, before Lightning restores them): torch restores a scheduler
    with ``__dict__.update(state)``, so any entry would become an attribute (``step``, ``optimizer``)
    and any value would be taken (a NaN factor, a negative patience). The saved entries must be
    those of the fresh scheduler's ``state_dict()``, each of the fresh value's kind
    (:func:`same_kind`), and the settings the scheduler's constructor takes must be accepted by it
    (:func:`check_scheduler_settings`). A checkpoint with another number of schedulers than the run
    is refused too (Lightning pairs them with ``zip``: one would be dropped or start afresh)."""
    if not isinstance(saved, list):
        return  # check_structure refused it as the file was read
    schedulers = [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", None) or []]
    if len(saved) != len(schedulers):
        built = ", ".join(type(s).__name__ for s in schedulers) or "none"
        raise ValueError(
            f"checkpoint {where}: lr_schedulers holds {len(saved)} scheduler state(s) but the run builds "
            f"{len(schedulers)} ({built}), so a schedule would be dropped or start afresh; {SCHEDULER_FIX}")
    for index, (scheduler, state) in enumerate(zip(schedulers, saved)):
        check_scheduler_state(scheduler, state, where, f"lr_schedulers[{index}]")


def check_scheduler_state(scheduler: Any, state: dict[str, Any], where: str, entry: str) -> None:
    """One saved scheduler state against ``scheduler`` as the run built it (see :func:`check_scheduler_states`)."""
    name = type(scheduler).__name__
    expect(isinstance(state, dict), where, entry, f"a dictionary (the state of a {name})", state)
    fresh = scheduler.state_dict()
    for key, value in state.items():
        if key not in fresh:
            shown = key if isinstance(key, str) else repr(key)
            raise ValueError(
                f"checkpoint {where}: {entry}.{shown} is not an entry of the run's {name} state (restoring it would set "
                f"that attribute of the scheduler), got {found(value)}; {SCHEDULER_FIX}")
    for key, value in fresh.items():
        if key not in state:
            raise ValueError(
                f"checkpoint {where}: {entry}.{key} is missing ({name} keeps it in its state; the resumed run would "
                f"silently start it afresh); {SCHEDULER_FIX}")
        same_kind(value, state[key], where, f"{entry}.{key}", key, name, nested=False)
    check_scheduler_settings(scheduler, state, fresh, where, entry)


def same_kind(fresh: Any, saved: Any, where: str, entry: str, key: str, name: str, nested: bool) -> None:
    """``saved`` is what ``fresh`` (the run's own scheduler's value) is: ``None``, a flag, a number
    (int and float alike; not NaN; infinite only where ``fresh`` is the same infinity; the
    counters, periods and rates of the tables above in their range), a tensor of its dtype and
    shape, a string (inside a list or dictionary: the same string, it names something), a list of
    as many entries, a ``Counter`` of epochs, a dictionary of the same keys; each entry likewise."""
    def expect_here(condition: bool, rule: str) -> None:
        if not condition:
            raise ValueError(f"checkpoint {where}: {entry} must be {rule}, got {found(saved)}; {SCHEDULER_FIX}")

    if fresh is None or isinstance(fresh, bool):
        expect_here(saved is None if fresh is None else isinstance(saved, bool),
                    f"{'null' if fresh is None else 'true or false'} (as the run's {name} has it)")
    elif isinstance(fresh, (int, float)):
        expect_here(isinstance(saved, (int, float)) and not isinstance(saved, bool), f"a number (as the run's {name} has it)")
        expect_here(not math.isnan(saved), "a number, not NaN")
        expect_here(math.isfinite(saved) or saved == fresh, "finite" if math.isfinite(fresh) else f"finite or {fresh}")
        if key in SCHEDULER_COUNTERS and natural(fresh):
            expect_here(natural(saved), "an integer >= 0 (a count)")
        elif key in SCHEDULER_PERIODS and natural(fresh):
            expect_here(natural(saved) and saved >= 1, "an integer >= 1 (a period)")
        elif key in SCHEDULER_NON_NEGATIVE:
            expect_here(saved >= 0, "a number >= 0")
    elif isinstance(fresh, torch.Tensor):
        expect_here(isinstance(saved, torch.Tensor) and saved.dtype == fresh.dtype and saved.shape == fresh.shape,
                    f"{found(fresh)} (as the run's {name} has it)")
        expect_here(not saved.is_floating_point() or bool(torch.isfinite(saved).all()), "finite")
    elif isinstance(fresh, str):
        expect_here(isinstance(saved, str) and (not nested or saved == fresh),
                    f"the string {fresh!r} (as the run's {name} has it)" if nested else "a string")
    elif isinstance(fresh, (list, tuple)):
        expect_here(isinstance(saved, (list, tuple)) and len(saved) == len(fresh),
                    f"a list of {len(fresh)} entries (as the run's {name} has it; one per parameter group where it keeps "
                    f"a value per group)")
        for number, (mine, theirs) in enumerate(zip(fresh, saved)):
            same_kind(mine, theirs, where, f"{entry}[{number}]", key, name, nested=True)
    elif isinstance(fresh, Counter):
        expect_here(isinstance(saved, Counter) and all(natural(k) and natural(n) and n >= 1 for k, n in saved.items()),
                    "a Counter of epochs (integers >= 0, each counted at least once)")
    elif isinstance(fresh, dict):
        expect_here(isinstance(saved, dict) and sorted(map(repr, saved)) == sorted(map(repr, fresh)),
                    f"a dictionary with the keys {', '.join(map(str, fresh)) or '(none)'} (as the run's {name} has it)")
        for inner, mine in fresh.items():
            same_kind(mine, saved[inner], where, f"{entry}.{inner}", str(inner), name, nested=True)
    else:
        expect_here(type(saved) is type(fresh), f"a {type(fresh).__name__} (as the run's {name} has it)")


def scheduler_arguments(cls: type) -> list[str]:
    """The settings ``cls``'s constructor takes: its own arguments and, while it passes
    ``**kwargs`` on (Lightning's ``ReduceLROnPlateau`` adds ``monitor``), its bases' arguments."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = list(inspect.signature(init).parameters.values())
        except (TypeError, ValueError):
            break
        names += [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and p.name not in NOT_SETTINGS and p.name not in names]
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break
    return names


def throwaway_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An optimizer with ``optimizer``'s groups and settings over one-value parameters (a
    scheduler's constructor may read the groups: their number, ``lr``, ``momentum``/``betas``)."""
    groups = [{**{k: v for k, v in group.items() if k not in ("params", "fused", "capturable", "foreach")},
               "params": [torch.zeros(1, requires_grad=True)]} for group in optimizer.param_groups]
    try:
        return type(optimizer)(groups)
    except (ValueError, TypeError, RuntimeError, KeyError):
        return torch.optim.SGD([{"params": g["params"], "lr": g.get("lr", 1e-3)} for g in groups])


def check_scheduler_settings(scheduler: Any, state: dict[str, Any], fresh: dict[str, Any], where: str, entry: str) -> None:
    """The saved values of the settings the scheduler's constructor takes (ReduceLROnPlateau's
    ``factor``, ``mode``, ``min_lrs``, ...; StepLR's ``step_size``, ``gamma``) are accepted by that
    constructor: a throwaway scheduler of the same class is built with them on an optimizer like the
    run's. Its refusal names the first setting that, put alone into the run's own settings, is
    refused. A scheduler whose state does not hold every argument its constructor needs (LambdaLR's
    function, OneCycleLR's ``max_lr``) cannot be rebuilt from it and is left to the checks above."""
    cls = type(scheduler)
    arguments = [a for a in scheduler_arguments(cls) if SAVED_AS.get(a, a) in state and SAVED_AS.get(a, a) in fresh]

    def settings(source: dict[str, Any]) -> dict[str, Any]:
        values = {a: source[SAVED_AS.get(a, a)] for a in arguments}
        return {a: sorted(v.elements()) if isinstance(v, Counter) else v for a, v in values.items()}

    def refusal(values: dict[str, Any]) -> str | None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cls(throwaway_optimizer(scheduler.optimizer), **values)
        except (ValueError, TypeError, RuntimeError, KeyError, ArithmeticError) as error:
            return str(error).splitlines()[0] if str(error).strip() else type(error).__name__
        return None

    own = settings(fresh)
    if not arguments or refusal(own) is not None:
        return  # the run's own scheduler cannot be rebuilt from its state: nothing to compare with
    saved = settings(state)
    reason = refusal(saved)
    if reason is None:
        return
    for argument in arguments:
        alone = refusal({**own, argument: saved[argument]})
        if alone is not None:
            key = SAVED_AS.get(argument, argument)
            raise ValueError(
                f"checkpoint {where}: {entry}.{key} must be a value {cls.__name__} accepts ({alone}), got "
                f"{found(state[key])}; {SCHEDULER_FIX}")
    raise ValueError(
        f"checkpoint {where}: {entry} holds settings {cls.__name__} refuses together ({reason}): "
        f"{', '.join(f'{SAVED_AS.get(a, a)}={saved[a]!r}' for a in arguments)}; {SCHEDULER_FIX}")
