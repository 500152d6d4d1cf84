"""Group-lasso pruning (Eq. 4; Algorithm 1, lines 7-9 of Liao et al.) and the per-epoch scale of the
head's lasso strengths."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from heads.validation import check_nonnegative
from tasks.callbacks.common import DS_GROUP, log_metrics, sparse_experts
from tasks.callbacks.mitosis import Mitosis, run_length
from tasks.callbacks.surgery import apply_structure_change

class GroupLassoPruning(Callback):
    """Prune rows with ``||W^e_(c,k)||_2 < threshold`` (Eq. 4; Algorithm 1, lines 7-9).

    Pruning is active once the monitored task loss is below ``loss_below`` or from
    ``start_epoch`` (whichever is set; both: either suffices), and is applied every
    ``every_n_steps`` optimizer steps. With mitosis, ``after_cloning=P`` replaces
    ``start_epoch``: each stage of the :class:`tasks.callbacks.Mitosis` schedule (the first one from
    the start of training, each next one from its cloning) prunes from ``P`` of the Mitosis
    unit (epochs or steps) after its start, so every cloning copies pruned experts (App. B:
    clone every 15 epochs, prune from 10 epochs after each cloning); with ``loss_below`` too,
    a stage prunes only while the task loss is also below it (Algorithm 1, line 7). A class's last kept row is never removed (the head's
    ``keep_last_copy``).

    The group-lasso strengths λ and λ_expert are the head's (``group_lasso_weight``,
    ``expert_lasso_weight``): the head is their one home, read when the callback first sees it.
    The callback only scales them per epoch, a function of the epoch so a resumed run gets the
    same schedule: by ``phase_scale`` in the pruning phase ``lasso_from_epoch <= epoch <
    lasso_until_epoch`` and by ``outside_scale`` before and after it. A λ small enough for the
    first epochs of learning can be far too small to drive any row below γ later, notably with
    balanced classes (character recognition, docs/hanzi.md): a phase with ``phase_scale > 1``
    prunes faster.

    Args:
        threshold: γ, the row-norm threshold.
        start_epoch: first epoch at which pruning is active.
        loss_below: prune once ``monitor`` is below this value.
        monitor: logged metric holding the task loss (every task logs it as ``train/loss``,
            the regularisers apart under ``train/reg/``).
        every_n_steps: steps between two pruning passes.
        after_cloning: epochs (or steps, as the Mitosis callback counts) from the start of each
            mitosis stage to the start of its pruning; needs a ``Mitosis`` callback, must be
            below its period (else every cloning copies unpruned experts), and needs
            ``start_epoch: null``. A last stage that the run ends before ``P`` is never pruned
            (warned when training starts).
        phase_scale: factor on the head's λ and λ_expert in the pruning phase.
        outside_scale: factor on them outside the phase (0: the lasso acts in the phase only).
        lasso_from_epoch: first epoch of the pruning phase.
        lasso_until_epoch: first epoch after the pruning phase (None: the phase runs to the end).
    """

    def __init__(
        self,
        threshold: float = 1e-3,
        start_epoch: int | None = 1,
        loss_below: float | None = None,
        monitor: str = "train/loss",
        every_n_steps: int = 50,
        phase_scale: float = 1.0,
        outside_scale: float = 1.0,
        lasso_from_epoch: int = 0,
        lasso_until_epoch: int | None = None,
        after_cloning: int | None = None,
    ) -> None:
        super().__init__()
        where = "trainer.callbacks.GroupLassoPruning.init_args"
        if after_cloning is not None:
            if isinstance(after_cloning, bool) or not isinstance(after_cloning, int) or after_cloning < 0:
                raise ValueError(f"GroupLassoPruning needs after_cloning >= 0 (an integer), got {after_cloning!r} "
                                 f"(set {where}.after_cloning)")
            if start_epoch is not None:
                raise ValueError(f"GroupLassoPruning after_cloning={after_cloning} replaces start_epoch, got start_epoch="
                                 f"{start_epoch} too (set {where}.start_epoch: null)")
        self.after_cloning = after_cloning
        self._mitosis: Any = None
        self.threshold = check_nonnegative(threshold, "threshold", "GroupLassoPruning", where)
        self.phase_scale = check_nonnegative(phase_scale, "phase_scale", "GroupLassoPruning", where)
        self.outside_scale = check_nonnegative(outside_scale, "outside_scale", "GroupLassoPruning", where)
        if lasso_from_epoch < 0:
            raise ValueError(f"GroupLassoPruning needs lasso_from_epoch >= 0, got {lasso_from_epoch} (set {where}.lasso_from_epoch)")
        if lasso_until_epoch is not None and lasso_until_epoch <= lasso_from_epoch:
            raise ValueError(
                f"GroupLassoPruning needs lasso_until_epoch > lasso_from_epoch ({lasso_from_epoch}), got {lasso_until_epoch}"
                f" (set {where}.lasso_until_epoch later, or null for no end)")
        self.lasso_from_epoch, self.lasso_until_epoch = lasso_from_epoch, lasso_until_epoch
        #: The head's (λ, λ_expert) as configured (None until the callback has seen the head).
        self.lasso_weights: tuple[float, float] | None = None
        self._head: Any = None
        if start_epoch is None and loss_below is None and after_cloning is None:
            raise ValueError(f"GroupLassoPruning needs start_epoch, after_cloning or loss_below, got none "
                             f"(set {where}.start_epoch)")
        if every_n_steps < 1:
            raise ValueError(f"GroupLassoPruning needs every_n_steps >= 1, got {every_n_steps} (set {where}.every_n_steps)")
        self.start_epoch, self.loss_below, self.monitor = start_epoch, loss_below, monitor
        self.every_n_steps = every_n_steps
        self.pruned_rows = 0
        #: Scheduled pruning passes the loss gate held back (``loss_below`` with ``after_cloning``).
        self.gated_passes = 0
        #: The monitored loss as last seen; a resumed run uses it until the metric is logged
        #: again (Lightning does not restore ``callback_metrics``, e.g. an older ``val/loss``).
        self.last_monitored: float | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._see_head(sparse_experts(pl_module, "GroupLassoPruning"))
        if self.after_cloning is not None:
            self._mitosis = self._find_mitosis(trainer)

    def _find_mitosis(self, trainer: pl.Trainer) -> Any:
        where = "trainer.callbacks.GroupLassoPruning.init_args"
        found = [c for c in trainer.callbacks if isinstance(c, Mitosis)]
        if not found:
            raise ValueError(f"GroupLassoPruning after_cloning={self.after_cloning} needs a tasks.callbacks.Mitosis callback, got "
                             f"none (add Mitosis to trainer.callbacks, or set {where}.start_epoch instead)")
        mitosis = found[0]
        if self.after_cloning >= mitosis.period:
            raise ValueError(
                f"GroupLassoPruning after_cloning={self.after_cloning} {mitosis.unit} is not before the next cloning "
                f"(Mitosis clones every {mitosis.period} {mitosis.unit}), so every cloning would copy unpruned experts "
                f"(set {where}.after_cloning below {mitosis.period})")
        return mitosis

    def _warn_unpruned_last_stage(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mitosis, head = self._mitosis, sparse_experts(pl_module, "GroupLassoPruning")
        first = mitosis.last_cloning(head.initial_experts) + self.after_cloning
        total = run_length(trainer, mitosis.unit)
        if first >= total:
            rank_zero_warn(
                f"GroupLassoPruning: pruning of the last mitosis stage would start at {mitosis.unit[:-1]} {first} "
                f"(last cloning at {mitosis.last_cloning(head.initial_experts)} + after_cloning={self.after_cloning}) but the "
                f"run has {int(total)} {mitosis.unit}, so the last stage ({mitosis.max_experts} experts) is never pruned "
                f"(lower trainer.callbacks.GroupLassoPruning.init_args.after_cloning or train longer)")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._mitosis is not None:
            self._warn_unpruned_last_stage(trainer, pl_module)

    def _see_head(self, head: Any) -> None:
        if head is not self._head:  # the configured values, before this callback scaled them
            self._head, self.lasso_weights = head, (float(head.group_lasso_weight), float(head.expert_lasso_weight))

    def _in_phase(self, epoch: int) -> bool:
        until = self.lasso_until_epoch
        return self.lasso_from_epoch <= epoch and (until is None or epoch < until)

    def scale_at(self, epoch: int) -> float:
        """The factor on the head's λ and λ_expert at ``epoch``."""
        return self.phase_scale if self._in_phase(epoch) else self.outside_scale

    def lasso_weights_at(self, epoch: int) -> tuple[float, float]:
        """(λ, λ_expert) at ``epoch`` (the head's values times :meth:`scale_at`; known once fitting started)."""
        if self.lasso_weights is None:
            raise RuntimeError("GroupLassoPruning.lasso_weights_at needs the head's lasso weights: call it after fit starts")
        scale = self.scale_at(epoch)
        return self.lasso_weights[0] * scale, self.lasso_weights[1] * scale

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "GroupLassoPruning")
        self._see_head(head)
        head.group_lasso_weight, head.expert_lasso_weight = self.lasso_weights_at(trainer.current_epoch)

    def _see_monitor(self, trainer: pl.Trainer) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None:
            self.last_monitored = float(value)
        elif self.loss_below is not None and self.last_monitored is None and trainer.global_step > 1:
            logged = ", ".join(sorted(name for name in trainer.callback_metrics if name.startswith("train/"))) or "none"
            raise ValueError(
                f"GroupLassoPruning loss_below={self.loss_below} monitors {self.monitor!r}, which the task does not log "
                f"(training metrics logged: {logged}); set trainer.callbacks.GroupLassoPruning.init_args.monitor to one of them")

    def active(self, trainer: pl.Trainer) -> bool:
        if self.after_cloning is not None:
            return self._stage_active(trainer)
        if self.start_epoch is not None and trainer.current_epoch >= self.start_epoch:
            return True
        self._see_monitor(trainer)
        return self.loss_below is not None and self.last_monitored is not None and self.last_monitored < self.loss_below

    def _stage_active(self, trainer: pl.Trainer) -> bool:
        """Past ``after_cloning`` in the current mitosis stage (and, with ``loss_below``, the task
        loss below it: Algorithm 1, line 7)."""
        mitosis = self._mitosis if self._mitosis is not None else self._find_mitosis(trainer)
        head = sparse_experts(trainer.lightning_module, "GroupLassoPruning")
        if mitosis.stage_position(trainer.current_epoch, trainer.global_step, head.initial_experts) < self.after_cloning:
            return False
        if self.loss_below is None:
            return True
        self._see_monitor(trainer)
        gate_open = self.last_monitored is not None and self.last_monitored < self.loss_below
        self.gated_passes += not gate_open
        log_metrics(trainer, {f"{DS_GROUP}/pruning/loss_gate_open": float(gate_open),
                              f"{DS_GROUP}/pruning/gated_passes": float(self.gated_passes)})
        return gate_open

    # A checkpoint can be written after validation or at the epoch end, where the monitored
    # value may have changed since the last batch: record it first (ModelCheckpoint runs last).
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._see_monitor(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._see_monitor(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"pruned_rows": self.pruned_rows, "last_monitored": self.last_monitored, "gated_passes": self.gated_passes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pruned_rows = int(state_dict.get("pruned_rows", 0))
        self.last_monitored = state_dict.get("last_monitored")
        self.gated_passes = int(state_dict.get("gated_passes", 0))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step % self.every_n_steps == 0 and self.active(trainer):
            self._prune(trainer, pl_module)

    def _prune(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "GroupLassoPruning")
        before = int(head.rows_per_expert().sum())
        apply_structure_change(trainer, head.prune(self.threshold))
        self.pruned_rows += before - int(head.rows_per_expert().sum())
