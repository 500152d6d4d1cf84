"""Run settings Lightning takes without checking them: refused with one line before anything is
built or written; and the one line for a batch that does not fit in memory.

Lightning divides by ``val_check_interval`` and ``accumulate_grad_batches`` in the middle of the
first epoch (a ``ZeroDivisionError`` for 0), trains nothing for ``max_epochs`` 0 and exits 0, hands a negative ``gradient_clip_val`` to
``clip_grad_norm_`` without a word, and passes ``seed_everything`` to numpy, whose message names
neither the option nor the range.
"""

from __future__ import annotations

import math
import re
from typing import Any

from jsonargparse import Namespace

from datamodules.files import format_bytes

#: The seeds numpy (and so ``seed_everything`` and the data modules' generators) accepts.
SEED_RANGE = (0, 2**32 - 1)


def invalid(key: str, value: Any, rule: str) -> ValueError:
    """The one-line error for an option's value, worded as the parser's own (app/errors.py)."""
    return ValueError(f"invalid value {value!r} for {key}: expected {rule} (fix --{key} or its entry in the config)")


def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_run_settings(config: Namespace) -> None:
    """Refuse trainer and seed settings that would fail (or be ignored) only once the run is under
    way. ``config`` is one subcommand's parsed configuration."""
    trainer = config.get("trainer") or Namespace()
    interval = trainer.get("val_check_interval")
    if (is_integer(interval) and interval < 1) or (isinstance(interval, float) and not 0 < interval <= 1):
        raise invalid("trainer.val_check_interval", interval,
                      "an integer >= 1 (training batches between validations) or a float in (0, 1] (a fraction of the epoch)")
    epochs = trainer.get("max_epochs")
    if is_integer(epochs) and epochs == 0:  # Lightning "fits" nothing and exits 0
        raise invalid("trainer.max_epochs", epochs, "an integer >= 1, or -1 for no limit (with trainer.max_steps)")
    accumulate = trainer.get("accumulate_grad_batches")
    if is_integer(accumulate) and accumulate < 1:
        raise invalid("trainer.accumulate_grad_batches", accumulate, "an integer >= 1 (batches per optimizer step; 1 accumulates nothing)")
    clip = trainer.get("gradient_clip_val")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and not (math.isfinite(clip) and clip >= 0):
        raise invalid("trainer.gradient_clip_val", clip, "a finite number >= 0 (0 or null clips nothing)")
    low, high = SEED_RANGE
    seeds = {"seed_everything": config.get("seed_everything")}
    data = config.get("data")
    if isinstance(data, Namespace) and isinstance(data.get("init_args"), Namespace):
        seeds["data.init_args.seed"] = data.init_args.get("seed")
    for key, seed in seeds.items():
        if is_integer(seed) and not low <= seed <= high:
            raise invalid(key, seed, f"an integer in {low}..{high} (the range numpy seeds)")


#: How torch's allocators say a tensor did not fit: the CPU allocator, CUDA and MPS.
_OUT_OF_MEMORY = re.compile(r"can't allocate memory|CUDA out of memory|MPS backend out of memory")
_REQUESTED = re.compile(r"(?:you tried to allocate|Tried to allocate) (\d+ bytes|[\d.]+ [KMGT]?i?B)")


def requested_size(error: BaseException) -> str | None:
    """How much a failed allocation asked for (``"1.2 GiB"``, ``"more than is free"`` when the
    message does not say), or ``None`` when ``error`` is not an allocation failure: torch's
    allocators (``RuntimeError``) or numpy's (``MemoryError``)."""
    text = " ".join(str(error).split())
    if isinstance(error, MemoryError):
        asked = re.search(r"allocate ([\d.]+) ([KMGTP]?i?B)", text)  # numpy: "Unable to allocate 119. GiB for ..."
        return f"{float(asked.group(1)):g} {asked.group(2)}" if asked else "more than is free"
    if not isinstance(error, RuntimeError) or not _OUT_OF_MEMORY.search(text):
        return None
    asked = _REQUESTED.search(text)
    if asked is None:
        return "more than is free"
    return format_bytes(int(asked.group(1).split()[0])) if asked.group(1).endswith(" bytes") else asked.group(1)


def allocation_failed_line(error: BaseException) -> str | None:
    """The one line for an allocation that failed outside a run's steps (None for another error):
    building a model or a dataset whose sizes do not fit in memory."""
    size = requested_size(error)
    if size is None:
        return None
    return (
        f"out of memory: an array of {size} could not be allocated while building the model or the data; their sizes come "
        f"from the command line, its config files and, with --ckpt_path / --ckpt, the checkpoint: lower the sizes you gave, "
        f"or use a checkpoint written by python -m app fit"
    )


def out_of_memory_line(error: BaseException, subcommand: str, data: Any) -> str | None:
    """The one line for an allocation that failed during ``subcommand`` (None for another error):
    how much was asked for and the batch-size options that set it (``data`` is the run's data
    settings, a ``Namespace`` with ``init_args``)."""
    size = requested_size(error) if isinstance(error, RuntimeError) else None
    if size is None:
        return None
    init_args = data.get("init_args") if isinstance(data, Namespace) else None
    given = [(key, init_args[key]) for key in ("batch_size", "eval_batch_size") if isinstance(init_args, Namespace) and key in init_args]
    options = " or ".join(f"data.init_args.{key} (now {value})" for key, value in given)
    fix = f"lower {options}" if options else "lower the batch size"
    return (
        f"out of memory during {subcommand}: a tensor of {size} could not be allocated; {fix}, "
        f"or the model's sizes, until a batch fits in memory"
    )
