"""Stop a run the moment its training goes non-finite, before a NaN weight reaches a checkpoint.

Two ways a run diverges, and where each is caught:

* a non-finite **loss** (NaN/Inf in the forward pass): checked every step in
  ``on_before_backward``, before the backward pass and the optimizer step, so the weights are
  still those of the last finite step. The check is one ``isfinite`` on a scalar the step
  computes anyway;
* finite loss, then an **optimizer step** that overflows the weights (a learning rate so large
  that ``w - lr * update`` leaves the float range). The next step's loss is then non-finite and
  caught as above, but a checkpoint may be written in between (a step checkpoint right after
  this optimizer step, or the end-of-epoch one after validation). So the weights are scanned
  where they are about to be *used or kept*, not after every step: before every checkpoint is
  assembled (``on_save_checkpoint``, before a byte is written), at the start of every
  validation during fit (so no NaN validation metric reaches ``ReduceLROnPlateau``, early
  stopping or a ``monitor``) and at the end of training (a run never ends "successfully" with
  non-finite weights). A per-step scan costs one ``isfinite`` reduction per parameter tensor, a
  sizeable share of a small model's step, far above what
  is worth paying for a check that the next step's loss makes anyway.

Either way the run stops with one :class:`FloatingPointError` naming the step, the epoch, the
value and the fix; ``app/main.py: run`` prints it as ``error: ...`` with exit code 2.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

#: The fix every message ends with (the CLI flags that change it).
FIX = ("lower the learning rate (--model.init_args.optimizer.init_args.lr) or clip gradients "
       "(--trainer.gradient_clip_val 1.0), then resume from the last checkpoint")


def learning_rate(trainer: pl.Trainer | None) -> float | None:
    """The first optimizer's first learning rate, for the message (``None`` before one exists)."""
    optimizers = getattr(trainer, "optimizers", None) or []
    return float(optimizers[0].param_groups[0]["lr"]) if optimizers else None


def position(trainer: pl.Trainer) -> str:
    """``global step S, epoch E`` of the trainer, and the learning rate when there is one."""
    lr = learning_rate(trainer)
    return f"global step {trainer.global_step}, epoch {trainer.current_epoch}" + (f" (learning rate {lr:g})" if lr is not None else "")


def step_overflow(trainer: pl.Trainer, error: RuntimeError) -> FloatingPointError:
    """The error for an optimizer step that torch refused because its size leaves the float range."""
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    return FloatingPointError(
        f"the optimizer step at {position(trainer)} overflows ({reason}); nothing was written from it: {FIX}"
    )


def first_non_finite(module: nn.Module) -> tuple[str, Tensor] | None:
    """``(name, tensor)`` of the first floating-point parameter holding a NaN/Inf, else ``None``.

    Parameters only: buffers may hold infinities on purpose (``-inf`` attention masks)."""
    tensors = [(name, t) for name, t in module.named_parameters() if t.is_floating_point() and t.numel()]
    if not tensors:
        return None
    with torch.no_grad():
        # One flag per tensor, one host sync for all of them.
        finite = torch.stack([torch.isfinite(t).all() for _, t in tensors]).cpu()
    for (name, tensor), ok in zip(tensors, finite.tolist()):
        if not ok:
            return name, tensor
    return None


def describe(name: str, tensor: Tensor) -> str:
    values = tensor.detach()
    nan, inf = int(torch.isnan(values).sum()), int(torch.isinf(values).sum())
    return f"{name} holds {nan} NaN and {inf} Inf of {values.numel()} values"


class NonFiniteGuard(pl.Callback):
    """The checks above, added to every :class:`tasks.base.HeadTask` run by its
    ``configure_callbacks`` (nothing to configure)."""

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        finite = bool(torch.isfinite(loss.detach()).all())
        # Under DDP a batch can overflow on one rank only: every rank must stop, or the others
        # would wait for it in the gradient all-reduce. One boolean all-reduce per step (none on
        # one process).
        if trainer.strategy.reduce_boolean_decision(finite, all=True):
            return
        batch = trainer.fit_loop.epoch_loop.batch_idx
        head = getattr(pl_module, "head", None)
        stats = head_scalars(head) if head is not None else {}
        lr = learning_rate(trainer)
        raise FloatingPointError(
            f"non-finite training loss {float(loss.detach().float().sum())} at global step {trainer.global_step}, "
            f"epoch {trainer.current_epoch}, batch {batch}"
            + (f"; head {type(head).__name__} stats {stats}" if head is not None else "")
            + (f"; learning rate {lr:g}" if lr is not None else "")
            + f"; no checkpoint was written from this step: {FIX}"
        )

    def check_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str) -> None:
        found = first_non_finite(pl_module)
        if found is None:
            return
        raise FloatingPointError(
            f"non-finite weights {when} at {position(trainer)}: {describe(*found)} (an optimizer step "
            f"overflowed them); nothing was written from them: {FIX}"
        )

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.check_weights(trainer, pl_module, "before writing a checkpoint")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.check_weights(trainer, pl_module, "before validation")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check_weights(trainer, pl_module, "at the end of training")


def head_scalars(head: Any) -> dict[str, float]:
    """The head's one-number statistics, rounded, for the loss message."""
    stats: dict[str, float] = {}
    for name, value in head.stats().items():
        if isinstance(value, Tensor) and value.numel() == 1:
            stats[name] = round(float(value), 6)
        elif isinstance(value, (int, float)):
            stats[name] = round(float(value), 6)
    return stats
