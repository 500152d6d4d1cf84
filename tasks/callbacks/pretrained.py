"""Train only the head while the network started from a trained run settles it (``fit
--pretrained.checkpoint ... --pretrained.freeze_steps N``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from tasks.callbacks.surgery import train_only


class FreezeNetwork(Callback):
    """For the first ``steps`` optimizer steps (``-1``: the whole run) only the head's parameters
    train; the network (encoder, embeddings: every parameter outside ``head``) is frozen
    (``requires_grad`` off, the DDP wrapper rebuilt), then everything trains. ``-1`` is DS-Softmax's
    Algorithm 1, which updates only the experts and the gate on the pre-trained network H. A new head on a pretrained network starts from
    random weights; its first gradients would otherwise reach the network's trained features.

    ``requires_grad`` is not part of a checkpoint: a run resumed before step ``steps`` freezes the
    network again when training starts. Frozen modules stay in train mode (dropout behaves as in
    training). Head parameters added later (DS-Softmax mitosis) train as they are created."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        if isinstance(steps, bool) or not isinstance(steps, int) or (steps < 1 and steps != -1):
            raise ValueError(f"FreezeNetwork needs steps >= 1 or -1 (the whole run), got {steps!r} (set --pretrained.freeze_steps)")
        self.steps = steps
        self.frozen = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.steps == -1 or trainer.global_step < self.steps:
            train_only(trainer, pl_module, [name for name, _ in pl_module.named_parameters() if name.startswith("head.")])
            self.frozen = True
            until = "for the whole run" if self.steps == -1 else f"until step {self.steps}"
            rank_zero_info(f"FreezeNetwork: only the head trains {until}")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.frozen and self.steps != -1 and trainer.global_step >= self.steps:
            train_only(trainer, pl_module, [name for name, _ in pl_module.named_parameters()])
            self.frozen = False
            rank_zero_info(f"FreezeNetwork: the whole model trains from step {trainer.global_step}")
