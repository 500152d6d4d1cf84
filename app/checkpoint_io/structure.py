"""The shape of a checkpoint: :func:`check_structure`, what every entry Lightning and the project
read must be (run by the reader, before anything is restored). Whether the weights and optimizer
state fit the model they are restored into is :mod:`tasks.checkpoint_fit` (run where a model is
restored: :meth:`tasks.base.HeadTask.on_load_checkpoint`, for the Trainer's restore and the tools').

Unpickling with ``weights_only`` guarantees that a file holds only data; these checks guarantee
that the data has the types and shapes its readers assume, so an edited entry (``loops`` a
string, an Adam moment of another shape, a NaN weight, an ``int8`` weight) is one line naming the
file and the entry instead of a traceback deep inside Lightning, a training run that fails after
it started, or a model that silently computes something else.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from packaging.version import InvalidVersion, Version

from app.checkpoint_io.classes import MAX_DEPTH
from tasks.checkpoint_fit import FIX, expect, found, natural

#: The oldest Lightning whose checkpoints are read: an older file would go through Lightning's
#: upgrade steps, which expect the entries of their own time (the project has no upgrade code).
OLDEST_LIGHTNING = Version("2.0.0")

#: The keys of :class:`datamodules.base.DataState` (``checkpoint["datamodule_state"]``).
DATA_STATE_KEYS = ("class_names", "tokenizer", "source_vocabulary", "source_tokenizer")

#: Lightning's entries that say a file was written by a Trainer (and so carries its version).
TRAINER_ENTRIES = ("epoch", "global_step", "loops", "optimizer_states")


def check_structure(checkpoint: dict[str, Any], where: str) -> None:
    """Refuse, in one line, a checkpoint entry that Lightning or the project reads and that does
    not have the type and shape it must have (see the module docstring); the state dict must
    hold floating-point tensors of finite values (integer buffers excepted)."""
    check_state_dict(checkpoint["state_dict"], where)
    check_nesting(checkpoint, where)
    version = checkpoint.get("pytorch-lightning_version")
    if version is None and any(key in checkpoint for key in TRAINER_ENTRIES):
        raise ValueError(f"checkpoint {where}: pytorch-lightning_version is missing (every checkpoint a Trainer writes "
                         f"has it); {FIX}")
    if version is not None:
        try:
            parsed = Version(version) if isinstance(version, str) else None
        except InvalidVersion:
            parsed = None
        expect(parsed is not None, where, "pytorch-lightning_version", "a version string such as '2.6.0'", version)
        expect(parsed >= OLDEST_LIGHTNING, where, "pytorch-lightning_version",
               f"{OLDEST_LIGHTNING} or newer (an older Lightning's checkpoint would need upgrade steps the project does not have)",
               version)
    for key in ("epoch", "global_step"):
        if key in checkpoint:
            expect(natural(checkpoint[key]), where, key, "an integer >= 0", checkpoint[key])
    for key in ("hparams_name", "datamodule_hparams_name", "datamodule_class_path"):
        if key in checkpoint:
            expect(isinstance(checkpoint[key], str), where, key, "a string", checkpoint[key])
    for key in ("hyper_parameters", "datamodule_hyper_parameters", "head_structure"):
        if key in checkpoint:
            expect(isinstance(checkpoint[key], dict), where, key, "a dictionary", checkpoint[key])
    for key in ("hyper_parameters", "datamodule_hyper_parameters"):
        if key in checkpoint:
            check_plain(checkpoint[key], where, key)
    for key in ("loops", "callbacks"):
        if key in checkpoint:
            check_mapping_of_mappings(checkpoint[key], where, key)
    if "loops" in checkpoint:
        for name, loop in checkpoint["loops"].items():
            check_counters(loop, where, f"loops.{name}")
    if "callbacks" in checkpoint:
        for name, state in checkpoint["callbacks"].items():
            check_callback_state(name, state, where)
    if "optimizer_states" in checkpoint:
        check_optimizer_states(checkpoint["optimizer_states"], where)
    if "lr_schedulers" in checkpoint:
        schedulers = checkpoint["lr_schedulers"]
        # their entries and values are compared with the run's own schedulers when fit resumes
        # (tasks.checkpoint_fit.check_scheduler_states): only fit restores them
        expect(isinstance(schedulers, list) and all(isinstance(s, dict) for s in schedulers), where, "lr_schedulers",
               "a list of dictionaries (one per scheduler)", schedulers)
    if "datamodule_state" in checkpoint:
        check_data_state(checkpoint["datamodule_state"], where)
    if "headbench" in checkpoint:
        record = checkpoint["headbench"]
        expect(isinstance(record, dict), where, "headbench", "a dictionary (task, head, data_fingerprint)", record)
        for key, value in record.items():
            expect(isinstance(value, str), where, f"headbench.{key}", "a string", value)
    if "tbptt" in checkpoint:
        check_tbptt(checkpoint["tbptt"], where)


def check_nesting(checkpoint: dict[str, Any], where: str) -> None:
    """Refuse any entry nested deeper than :data:`MAX_DEPTH` levels (Lightning's own entries are a
    few levels deep); walked without recursion, each container once, so a file built to nest
    thousands of levels or to repeat one object is one line, not a ``RecursionError`` in a later
    reader."""
    pending: list[tuple[Any, str, int]] = [(value, key, 1) for key, value in checkpoint.items() if key != "state_dict"]
    seen: set[int] = set()
    while pending:
        value, entry, depth = pending.pop()
        if not isinstance(value, (dict, list, tuple)) or id(value) in seen:
            continue
        seen.add(id(value))
        if depth > MAX_DEPTH:
            raise ValueError(f"checkpoint {where}: {entry[:80]} is nested deeper than {MAX_DEPTH} levels; {FIX}")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        pending.extend((inner, f"{entry}.{key}", depth + 1) for key, inner in items)


def check_plain(value: Any, where: str, entry: str, depth: int = 0, seen: set[int] | None = None) -> None:
    """Hyper-parameters are configuration, as a YAML file holds it: strings, numbers, booleans,
    null, and lists and dictionaries of them (they are parsed as the command line's model
    settings). Each container is visited once; nesting beyond :data:`MAX_DEPTH` is left to
    :func:`~app.checkpoint_io.classes.check_depth`, which names it."""
    seen = set() if seen is None else seen
    if isinstance(value, (dict, list, tuple)):
        if id(value) in seen or depth > MAX_DEPTH:
            return
        seen.add(id(value))
        for key, inner in value.items() if isinstance(value, dict) else enumerate(value):
            check_plain(inner, where, f"{entry}.{key}", depth + 1, seen)
    else:
        expect(value is None or isinstance(value, (str, int, float, bool)), where, entry,
               "configuration data (a string, number, boolean, null, list or dictionary)", value)


def check_state_dict(state_dict: dict[str, Any], where: str) -> None:
    """Every entry a tensor under a string name; every floating-point value finite."""
    for name, value in state_dict.items():
        expect(isinstance(name, str), where, "state_dict", "keyed by parameter names (strings)", name)
        expect(isinstance(value, torch.Tensor), where, f"state_dict.{name}", "a tensor", value)
        if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
            count = int((~torch.isfinite(value)).sum())
            raise ValueError(
                f"checkpoint {where}: state_dict.{name} holds {count} non-finite value(s) (NaN or Inf), and weights must be "
                f"finite: it was saved from a diverged run or edited; use an earlier checkpoint of the run or retrain with "
                f"python -m app fit"
            )


def check_mapping_of_mappings(value: Any, where: str, entry: str) -> None:
    """A dictionary of named dictionaries (``loops``: one state per loop; ``callbacks``: per callback)."""
    expect(isinstance(value, dict), where, entry, "a dictionary", value)
    for key, inner in value.items():
        expect(isinstance(key, str), where, entry, "keyed by names (strings)", key)
        expect(isinstance(inner, dict), where, f"{entry}.{key}", "a dictionary", inner)


def check_counters(value: Any, where: str, entry: str, depth: int = 0) -> None:
    """A loop's state: nested dictionaries whose progress counters (``total``, ``current``:
    ``ready``, ``started``, ``processed``, ``completed``) are integers >= 0 and whose
    ``is_last_batch`` is a boolean."""
    if not isinstance(value, dict) or depth > 8:
        return
    for key, inner in value.items():
        here = f"{entry}.{key}"
        if key in ("total", "current"):
            expect(isinstance(inner, dict), where, here, "a dictionary of progress counters", inner)
            for counter, count in inner.items():
                expect(natural(count), where, f"{here}.{counter}", "an integer >= 0", count)
        elif key == "is_last_batch":
            expect(isinstance(inner, bool), where, here, "true or false", inner)
        elif key.endswith("state_dict"):
            expect(isinstance(inner, dict), where, here, "a dictionary", inner)
            check_counters(inner, where, here, depth + 1)
        else:
            check_counters(inner, where, here, depth + 1)


#: What ``ModelCheckpoint.load_state_dict`` reads, by key: (rule, test).
MODEL_CHECKPOINT_STATE: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "monitor": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "dirpath": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "best_model_path": ("a string", lambda v: isinstance(v, str)),
    "kth_best_model_path": ("a string", lambda v: isinstance(v, str)),
    "last_model_path": ("a string", lambda v: isinstance(v, str)),
    "best_model_score": ("a one-value tensor or null", lambda v: v is None or isinstance(v, torch.Tensor) and v.numel() == 1),
    "current_score": ("a one-value tensor or null", lambda v: v is None or isinstance(v, torch.Tensor) and v.numel() == 1),
    "kth_value": ("a one-value tensor or a number", lambda v: isinstance(v, (torch.Tensor, float, int)) and not isinstance(v, bool)
                  and (not isinstance(v, torch.Tensor) or v.numel() == 1)),
    "best_k_models": ("a dictionary of paths to one-value tensors", lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(s, (torch.Tensor, float, int)) for k, s in v.items())),
}


def check_callback_state(name: str, state: dict[str, Any], where: str) -> None:
    """The states of the callbacks every run has: the checkpoint callback's bookkeeping
    (:data:`MODEL_CHECKPOINT_STATE`) and, in checkpoints written before the training loaders
    became torchdata ``StatefulDataLoader`` s, the training loader's position (the since removed
    ``LoaderPosition`` callback: a list of loader states, dictionaries)."""
    entry = f"callbacks.{name.split('{')[0]}"
    if name.startswith(("TopKAndLastCheckpoint", "ModelCheckpoint")):
        for key, (rule, holds) in MODEL_CHECKPOINT_STATE.items():
            if key in state or key == "best_model_path":
                expect(holds(state.get(key)), where, f"{entry}.{key}", rule, state.get(key))
    elif name == "LoaderPosition":
        loaders = state.get("loaders")
        expect(loaders is None or isinstance(loaders, list) and all(isinstance(s, dict) for s in loaders), where,
               f"{entry}.loaders", "a list of loader states (dictionaries)", loaders)
        for index, loader in enumerate(loaders or []):
            for key in ("epoch", "batches_done", "world_size", "global_batch"):
                if key in loader:
                    expect(natural(loader[key]), where, f"{entry}.loaders[{index}].{key}", "an integer >= 0", loader[key])


#: Optimizer settings that are switches (``foreach``, ``fused``: also null).
FLAG_SETTINGS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "nesterov",
                 "decoupled_weight_decay", "centered")
#: Optimizer settings that are numbers (``betas``: a pair of numbers).
NUMERIC_SETTINGS = ("lr", "initial_lr", "eps", "weight_decay", "momentum", "dampening", "alpha", "lr_decay", "rho")


def check_optimizer_states(states: Any, where: str) -> None:
    """A list of ``torch.optim.Optimizer.state_dict()``: ``state`` maps a parameter number to
    that parameter's state (tensors and numbers), ``param_groups`` lists the groups, each with the
    distinct parameter numbers it holds; every number with a state is in a group."""
    expect(isinstance(states, list), where, "optimizer_states", "a list (one state per optimizer)", states)
    for index, state in enumerate(states):
        entry = f"optimizer_states[{index}]"
        expect(isinstance(state, dict) and "state" in state and "param_groups" in state, where, entry,
               "a dictionary with state and param_groups (torch.optim.Optimizer.state_dict())", state)
        groups = state["param_groups"]
        expect(isinstance(groups, list) and len(groups) > 0 and all(isinstance(g, dict) for g in groups), where,
               f"{entry}.param_groups", "a non-empty list of dictionaries", groups)
        numbers: list[Any] = []
        for number, group in enumerate(groups):
            params = group.get("params")
            expect(isinstance(params, list) and all(natural(p) for p in params), where,
                   f"{entry}.param_groups[{number}].params", "a list of parameter numbers (integers >= 0)", params)
            for key, setting in group.items():
                here = f"{entry}.param_groups[{number}].{key}"
                if key in NUMERIC_SETTINGS:
                    expect(isinstance(setting, (int, float)) and not isinstance(setting, bool) and math.isfinite(setting),
                           where, here, "a finite number", setting)
                elif key in FLAG_SETTINGS:
                    expect(setting is None or isinstance(setting, bool), where, here, "true, false or null", setting)
                elif key == "betas":
                    expect(isinstance(setting, (tuple, list)) and len(setting) == 2 and all(
                        isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) for b in setting),
                        where, here, "a pair of finite numbers", setting)
            numbers += params
        expect(len(set(numbers)) == len(numbers), where, f"{entry}.param_groups", "groups of distinct parameter numbers",
               numbers)
        expect(isinstance(state["state"], dict), where, f"{entry}.state", "a dictionary", state["state"])
        keys = None
        for number, values in state["state"].items():
            expect(number in numbers, where, f"{entry}.state", "keyed by the parameter numbers of its param_groups", number)
            expect(isinstance(values, dict), where, f"{entry}.state[{number}]", "a dictionary", values)
            # an optimizer keeps the same entries for every parameter (step, exp_avg, ...) and reads them all
            keys = sorted(map(str, values)) if keys is None else keys
            expect(sorted(map(str, values)) == keys, where, f"{entry}.state[{number}]",
                   f"a state with the entries every other parameter's has ({', '.join(keys)})", sorted(map(str, values)))
            for key, value in values.items():
                expect(value is None or isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool), where,
                       f"{entry}.state[{number}].{key}", "a tensor, a number or null", value)
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    expect(bool(torch.isfinite(value).all()), where, f"{entry}.state[{number}].{key}", "finite", value)


def check_data_state(state: Any, where: str) -> None:
    """:class:`datamodules.base.DataState`: exactly its four keys, class names a list of strings,
    the source vocabulary a list of strings or ``None``, the tokenizers dictionaries or ``None``."""
    expect(isinstance(state, dict) and sorted(map(str, state)) == sorted(DATA_STATE_KEYS), where, "datamodule_state",
           f"a dictionary with the keys {', '.join(DATA_STATE_KEYS)}", state)
    rules: dict[str, tuple[str, Callable[[Any], bool]]] = {
        "class_names": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v)),
        "source_vocabulary": ("a list of strings or null", lambda v: v is None or isinstance(v, list) and all(isinstance(n, str) for n in v)),
        "tokenizer": ("a tokenizer's dictionary (with its kind) or null", lambda v: v is None or isinstance(v, dict) and isinstance(v.get("kind"), str)),
        "source_tokenizer": ("a tokenizer's dictionary (with its kind) or null", lambda v: v is None or isinstance(v, dict) and isinstance(v.get("kind"), str)),
    }
    for key, (rule, holds) in rules.items():
        expect(holds(state[key]), where, f"datamodule_state.{key}", rule, state[key])


def check_tbptt(record: Any, where: str) -> None:
    """The language model's resume record (:meth:`tasks.language_model.LanguageModel.on_save_checkpoint`):
    its position, the carried LSTM state (float tensors) and the CPU random-number state (what
    ``torch.get_rng_state`` returns: a 1-D ``uint8`` tensor of its length)."""
    expect(isinstance(record, dict), where, "tbptt", "a dictionary", record)
    for key in ("epoch", "windows_done"):
        expect(natural(record.get(key)), where, f"tbptt.{key}", "an integer >= 0", record.get(key))
    expect(isinstance(record.get("epoch_complete"), bool), where, "tbptt.epoch_complete", "true or false", record.get("epoch_complete"))
    state = record.get("state")
    expect(state is None or isinstance(state, (list, tuple)) and all(
        isinstance(layer, (list, tuple)) and all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 3
                                                 for t in layer) for layer in state),
        where, "tbptt.state", "null or a list of layers, each a tuple of (layers, B, H) float tensors", state)
    rng = record.get("rng_state")
    expected = torch.get_rng_state()
    expect(isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8 and rng.shape == expected.shape, where,
           "tbptt.rng_state", f"a uint8 tensor of shape {tuple(expected.shape)} (torch.get_rng_state())", rng)
    cuda = record.get("cuda_rng_state")
    expect(cuda is None or isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8 and cuda.dim() == 1, where,
           "tbptt.cuda_rng_state", "null or a 1-D uint8 tensor", cuda)
