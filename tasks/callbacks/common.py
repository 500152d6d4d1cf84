"""What the DS-Softmax callbacks share: finding the sparse-experts head, per-epoch per-expert
sums of the training batches that survive resume and cloning, rank sums and logging."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from heads.ds.interface import SparseExperts

#: The TensorBoard group of the DS-Softmax callbacks' statistics (``~ds/balance/cv_load``,
#: ``~ds/sparsity/...``, ``~ds/mitosis/...``). TensorBoard's Scalars and Time Series views group
#: tags by their first ``/`` segment and order the groups by character code (its
#: ``compareTagNames``): ``epoch`` < ``lr-Adam`` < ``test`` < ``train`` < ``val``. A ``ds`` group
#: would sort before ``train`` and ``val``; ``~`` sorts after every letter, so the task's own groups
#: come first.
DS_GROUP = "~ds"


def head_with(pl_module: pl.LightningModule, interface: type, owner: str, needs: str, fix: str) -> Any:
    """The module's head when it implements ``interface`` (a runtime-checkable Protocol), else one
    line: ``{owner} needs {needs}, got <head class> ({fix})``."""
    head = getattr(pl_module, "head", None)
    if not isinstance(head, interface):
        raise ValueError(f"{owner} needs {needs}, got {type(head).__name__} ({fix})")
    return head


def sparse_experts(pl_module: pl.LightningModule, owner: str) -> SparseExperts:
    """The module's head, checked against the sparse-experts interface."""
    return head_with(pl_module, SparseExperts, owner, "model.head to expose the sparse-experts interface (e.g. heads.DSSoftmax)",
                     "set model.init_args.head to ds_softmax or remove the callback")


def continue_across_mitosis(total: Tensor | None, num_experts: int) -> Tensor | None:
    """Per-expert sums of this epoch continued across a cloning step: the clones (appended after
    their parents, see ``split_experts``) start at zero; any other change of size restarts."""
    if total is None or total.shape[0] == num_experts:
        return total
    if total.shape[0] < num_experts:
        return torch.cat([total, total.new_zeros(num_experts - total.shape[0])])
    return None


class EpochAccumulator(Callback):
    """Per-expert statistics of the *training* batches of the current epoch, kept across resume.

    ``load`` counts the contexts each expert was chosen for by the training batches of the
    epoch (the difference of the head's routing counts around each training batch, so
    validation, sanity checks and a resumed run's extra start-up passes are not counted);
    ``importance`` sums the gate mass (Σ_x G(x)). Both are this rank's sums; the epoch-end
    reduction adds the ranks. Checkpoints hold them summed over ranks (every rank joins
    ``state_dict``, Lightning dumps the checkpoint on all of them) and a run resumed in the
    same epoch gives them back to rank 0 only, so the epoch-end sum is the uninterrupted one.
    """

    def __init__(self) -> None:
        super().__init__()
        self._epoch = -1
        self._load: Tensor | None = None
        self._importance: Tensor | None = None
        self._routed_before: Tensor | None = None
        self._resumed: dict[str, Any] | None = None
        self._trainer: pl.Trainer | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer  # state_dict() takes no trainer but must sum over ranks

    def _start_epoch(self, trainer: pl.Trainer) -> None:
        resumed, self._resumed = self._resumed, None
        self._epoch, self._load, self._importance = trainer.current_epoch, None, None
        if resumed is not None and resumed["epoch"] == trainer.current_epoch and trainer.global_rank == 0:
            self._load, self._importance = resumed["load"], resumed["importance"]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._epoch != trainer.current_epoch:
            # Lightning 2.6 does not call on_train_epoch_start when it resumes mid-epoch.
            self._start_epoch(trainer)
        self._routed_before = pl_module.head.routing_counts().clone()

    def _accumulate(self, head: SparseExperts) -> None:
        counts = head.routing_counts()
        before = self._routed_before
        # A cloning step inside this batch reset the head's counts to zeros of the new size.
        routed = counts - before if before is not None and before.shape == counts.shape else counts.clone()
        load = continue_across_mitosis(self._load, head.num_experts)
        self._load = routed if load is None else load + routed
        importance = head.last_importance()
        if importance is not None:
            importance = importance.detach().float().cpu()
            total = continue_across_mitosis(self._importance, importance.shape[0])
            self._importance = importance if total is None else total + importance

    def _rank_sum(self, tensor: Tensor | None) -> Tensor | None:
        if tensor is None or self._trainer is None or self._trainer.world_size == 1:
            return tensor
        return reduce_sum(self._trainer, tensor)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "load": self._rank_sum(self._load), "importance": self._rank_sum(self._importance)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Applied at the next epoch start: the resumed epoch continues these sums, a new one restarts.
        self._resumed = {key: state_dict.get(key) for key in ("epoch", "load", "importance")}
        self._resumed["epoch"] = -1 if self._resumed["epoch"] is None else int(self._resumed["epoch"])


def reduce_sum(trainer: pl.Trainer, tensor: Tensor) -> Tensor:
    """Sum across ranks (each rank counted its own contexts once)."""
    if trainer.world_size > 1:
        device = trainer.strategy.root_device
        # A copy: the all-reduce works in place, and ``tensor`` may be a running accumulator
        # (reducing it for a checkpoint must not add the other ranks into it).
        return trainer.strategy.reduce(tensor.detach().to(device, torch.float32, copy=True), reduce_op="sum").cpu()
    return tensor.float()


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
