"""Whether a checkpoint fits the model and Trainer it is restored into: :func:`check_fits_model`
(weights' dtypes and shapes, tied weights, optimizer moments) and :func:`check_fits_trainer` (the
loops' state), run by :meth:`tasks.base.HeadTask.on_load_checkpoint` before Lightning loads
anything; the reader's checks of the file itself are :mod:`app.checkpoint_io.structure`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

#: What every refusal of an edited entry tells the user to do.
FIX = "it is damaged or was edited; use another checkpoint of the run (last.ckpt or best-*.ckpt) or retrain with python -m app fit"

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
                f"{tuple(target.shape)}: its structure does not match its weights; {FIX}"
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
