"""Load balancing of DS-Softmax experts: the schedule of the head's λ_load and balance statistics."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from heads.ds.interface import SparseExperts
from tasks.callbacks.common import DS_GROUP, EpochAccumulator, log_metrics, reduce_sum, sparse_experts

WHERE = "trainer.callbacks.LoadBalancing.init_args"


class LoadBalancing(EpochAccumulator):
    """Schedule the head's λ_load (linear warm-up over ``warmup_epochs``, 0 from ``until_epoch``
    on) and log balance statistics.

    λ_load itself is the head's ``load_balance_weight`` (``head.init_args.load_balance_weight``),
    read when the callback first sees the head; the callback only scales it per epoch, so the
    head is the one place that sets it. The schedule is a function of the epoch, so a resumed
    run gets the same weights.

    ``until_epoch`` ends the balancing, e.g. once the experts are grown
    (``configs/hierarchy/ds100x100.yaml``): on pruned experts, a balancing loss on a trainable
    gate pulls contexts away from the experts that keep their classes.

    Logs, per epoch, the coefficient of variation of expert *importance* (summed gate
    values, what the loss acts on) and of expert *load* (training contexts routed), both
    summed across ranks, and λ_load (``~ds/balance/*``, :data:`tasks.callbacks.common.DS_GROUP`).

    Args:
        warmup_epochs: epochs over which λ_load rises linearly to the head's value (0: none).
        until_epoch: first epoch without balancing (None: balancing to the end).
    """

    def __init__(self, warmup_epochs: int = 0, until_epoch: int | None = None) -> None:
        super().__init__()
        if warmup_epochs < 0:
            raise ValueError(f"LoadBalancing needs warmup_epochs >= 0, got {warmup_epochs} (set {WHERE}.warmup_epochs)")
        if until_epoch is not None and until_epoch < 1:
            raise ValueError(f"LoadBalancing needs until_epoch >= 1 or null, got {until_epoch} (set {WHERE}.until_epoch)")
        self.warmup_epochs, self.until_epoch = warmup_epochs, until_epoch
        #: The head's λ_load as configured (None until the callback has seen the head).
        self.weight: float | None = None
        self._head: SparseExperts | None = None

    def scale_at(self, epoch: int) -> float:
        """The factor on the head's λ_load at ``epoch``."""
        if self.until_epoch is not None and epoch >= self.until_epoch:
            return 0.0
        if self.warmup_epochs == 0:
            return 1.0
        return min(1.0, (epoch + 1) / self.warmup_epochs)

    def weight_at(self, epoch: int) -> float:
        """λ_load at ``epoch`` (the head's value times :meth:`scale_at`; known once fitting started)."""
        if self.weight is None:
            raise RuntimeError("LoadBalancing.weight_at needs the head's load_balance_weight: call it after fit starts")
        return self.weight * self.scale_at(epoch)

    def _start_epoch(self, trainer: pl.Trainer) -> None:
        head = sparse_experts(trainer.lightning_module, "LoadBalancing")
        if head is not self._head:  # the configured value, before this callback scheduled it
            self._head, self.weight = head, float(head.load_balance_weight)
        head.load_balance_weight = self.weight_at(trainer.current_epoch)
        super()._start_epoch(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_epoch(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._accumulate(sparse_experts(pl_module, "LoadBalancing"))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "LoadBalancing")
        metrics = {f"{DS_GROUP}/balance/load_balance_weight": head.load_balance_weight}
        own = self._load if self._load is not None else torch.zeros(head.num_experts)
        load = reduce_sum(trainer, own)
        if load.sum() > 0:
            metrics[f"{DS_GROUP}/balance/cv_load"] = float(load.std(unbiased=False) / load.mean())
        if self._importance is not None:
            importance = reduce_sum(trainer, self._importance)
            metrics[f"{DS_GROUP}/balance/cv_importance"] = float(importance.std(unbiased=False) / importance.mean().clamp_min(1e-12))
        log_metrics(trainer, metrics)
