"""DS-Softmax training schedule as Lightning callbacks (Algorithm 1 and App. B of Liao et al.).

They act on any head satisfying :class:`heads.ds_softmax.SparseExperts` (found at
``pl_module.head``), not on a concrete class:

* :class:`Mitosis` clones every expert every N epochs (or steps), ``K0 -> 2K0 -> ... -> K_max``;
* :class:`GroupLassoPruning` removes rows whose norm fell below γ (Eq. 4) once the task loss
  is low enough or from a given epoch (Algorithm 1, lines 7-9); optionally (``rewind``, not in
  the paper) a bounded pruning phase only selects the rows and the routing, and the other
  weights return to their values from before the phase; then (``refit``) the head alone can
  train on with the encoder frozen, for the rest of the run or until ``refit_until_epoch``;
* :class:`LoadBalancing` schedules λ_load and logs the spread of expert importance and load;
* :class:`RoutingLoss` switches the head's routing loss on from a given epoch;
* :class:`SparsityTracker` logs sparsity, utilisation, theoretical speed-up, FLOPs reduction,
  redundancy, memory and an expert x class heatmap.

Structure changes (mitosis, pruning) re-allocate head parameters. :func:`apply_structure_change`
then (1) swaps the new parameters into every optimizer in place, carrying each surviving or
cloned row's state (Adam moments, momentum) over from its source row, so learning-rate
schedulers keep pointing at the same optimizer; and (2) rebuilds the DDP wrapper, because
DDP registers gradient hooks and buckets for the parameters it saw when it was built: new
parameters would silently never be all-reduced. Building the wrapper again also broadcasts
rank 0's parameters and buffers, so replicas stay bit-identical.

Resume: every callback's running state (pruned-row count and last seen monitored loss,
the epoch's routed load and importance, the memory report, the last sparsity summary) is in
its ``state_dict`` and so in every checkpoint; schedules are functions of the epoch / global
step and the clone noise comes from a seeded generator, so a run killed after a mitosis and a
pruning step and resumed from its last checkpoint repeats the uninterrupted run exactly
(tests/test_resume_ds.py, docs/reliability.md).
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from heads.ds_softmax import ParameterRemap, SparseExperts, check_nonnegative, speedup


def sparse_experts(pl_module: pl.LightningModule, owner: str) -> SparseExperts:
    """The module's head, checked against the sparse-experts interface."""
    head = getattr(pl_module, "head", None)
    if not isinstance(head, SparseExperts):
        raise ValueError(
            f"{owner} needs model.head to expose the sparse-experts interface (e.g. heads.DSSoftmax), got "
            f"{type(head).__name__} (set model.init_args.head to ds_softmax or remove the callback)"
        )
    return head


def _remap_state(state: dict[str, Any], old_rows: int, source_rows: Tensor) -> dict[str, Any]:
    """Row-wise optimizer state (moments, momentum) follows its source row; scalars (step) stay."""
    remapped = {}
    for key, value in state.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == old_rows:
            remapped[key] = value.index_select(0, source_rows.to(value.device))
        else:
            remapped[key] = value
    return remapped


def apply_structure_change(trainer: pl.Trainer, remaps: list[ParameterRemap]) -> None:
    """Carry optimizer state over to re-allocated parameters and rebuild the DDP wrapper."""
    if not remaps:
        return
    for optimizer in trainer.optimizers:
        for old, new, source_rows in remaps:
            for group in optimizer.param_groups:
                for i, param in enumerate(group["params"]):
                    if param is old:
                        group["params"][i] = new
                        if old in optimizer.state:
                            optimizer.state[new] = _remap_state(optimizer.state.pop(old), old.shape[0], source_rows)
    _rebuild_ddp(trainer)


def _rebuild_ddp(trainer: pl.Trainer) -> None:
    """DDP only reduces the parameters it was built with, those that required grad then (see the
    module docstring): rebuild the wrapper after parameters were added, replaced or frozen."""
    strategy = trainer.strategy
    if isinstance(getattr(strategy, "model", None), DistributedDataParallel):
        strategy.model = strategy._setup_model(strategy.model.module)
        if hasattr(strategy, "_register_ddp_hooks"):
            strategy._register_ddp_hooks()


def optimizer_bytes(trainer: pl.Trainer, module: torch.nn.Module) -> int:
    """Bytes of optimizer state held for ``module``'s parameters."""
    params = {id(p) for p in module.parameters()}
    total = 0
    for optimizer in trainer.optimizers:
        for param, state in optimizer.state.items():
            if id(param) in params:
                total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor))
    return total


def _continue_across_mitosis(total: Tensor | None, num_experts: int) -> Tensor | None:
    """Per-expert sums of this epoch continued across a cloning step: the clones (appended after
    their parents, see ``split_experts``) start at zero; any other change of size restarts."""
    if total is None or total.shape[0] == num_experts:
        return total
    if total.shape[0] < num_experts:
        return torch.cat([total, total.new_zeros(num_experts - total.shape[0])])
    return None


class _EpochAccumulator(Callback):
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
        load = _continue_across_mitosis(self._load, head.num_experts)
        self._load = routed if load is None else load + routed
        importance = head.last_importance()
        if importance is not None:
            importance = importance.detach().float().cpu()
            total = _continue_across_mitosis(self._importance, importance.shape[0])
            self._importance = importance if total is None else total + importance

    def _rank_sum(self, tensor: Tensor | None) -> Tensor | None:
        if tensor is None or self._trainer is None or self._trainer.world_size == 1:
            return tensor
        return _reduce_sum(self._trainer, tensor)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "load": self._rank_sum(self._load), "importance": self._rank_sum(self._importance)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Applied at the next epoch start: the resumed epoch continues these sums, a new one restarts.
        self._resumed = {key: state_dict.get(key) for key in ("epoch", "load", "importance")}
        self._resumed["epoch"] = -1 if self._resumed["epoch"] is None else int(self._resumed["epoch"])


def _reduce_sum(trainer: pl.Trainer, tensor: Tensor) -> Tensor:
    """Sum across ranks (each rank counted its own contexts once)."""
    if trainer.world_size > 1:
        device = trainer.strategy.root_device
        # A copy: the all-reduce works in place, and ``tensor`` may be a running accumulator
        # (reducing it for a checkpoint must not add the other ranks into it).
        return trainer.strategy.reduce(tensor.detach().to(device, torch.float32, copy=True), reduce_op="sum").cpu()
    return tensor.float()


def _log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


class Mitosis(Callback):
    """Grow the experts by cloning (App. B): ``initial_experts -> 2x -> ... -> max_experts``.

    The schedule is a function of the epoch (or global step), so a resumed run continues it:
    at epoch ``e`` the head has ``min(max_experts, initial_experts * 2 ** (e // every_n_epochs))``
    experts. Cloning happens at the start of an epoch (or before a step), outside any
    forward/backward pass. After each cloning the head's parameter and optimizer memory is
    recorded in :attr:`memory_report` and logged.

    Args:
        initial_experts: ``K0``, the head's ``num_experts`` at the start of training.
        max_experts: ``K_max``; must be ``K0`` times a power of two.
        every_n_epochs: epochs between two cloning steps (exclusive with ``every_n_steps``).
        every_n_steps: optimizer steps between two cloning steps.
        noise: relative noise added to the clones (see ``DSSoftmax.split_experts``).
        seed: seed of the clone noise; identical on every rank.
    """

    def __init__(
        self,
        initial_experts: int = 2,
        max_experts: int = 64,
        every_n_epochs: int | None = 1,
        every_n_steps: int | None = None,
        noise: float = 0.01,
        seed: int = 0,
    ) -> None:
        super().__init__()
        where = "trainer.callbacks.Mitosis.init_args"
        if initial_experts < 1:
            raise ValueError(f"Mitosis needs initial_experts >= 1, got {initial_experts} (set {where}.initial_experts)")
        ratio = max_experts / initial_experts
        if max_experts < initial_experts or max_experts % initial_experts or not math.log2(ratio).is_integer():
            raise ValueError(
                f"Mitosis needs max_experts reachable from initial_experts by doubling, got initial_experts="
                f"{initial_experts} and max_experts={max_experts} (set {where}.max_experts to "
                f"{initial_experts * 2 ** max(0, round(math.log2(max(ratio, 1))))})"
            )
        if (every_n_epochs is None) == (every_n_steps is None):
            raise ValueError(
                f"Mitosis needs exactly one of every_n_epochs / every_n_steps, got {every_n_epochs} / "
                f"{every_n_steps} (set the other one to null in {where})"
            )
        for key, value in (("every_n_epochs", every_n_epochs), ("every_n_steps", every_n_steps)):
            if value is not None and value < 1:
                raise ValueError(f"Mitosis needs {key} >= 1, got {value} (set {where}.{key})")
        self.initial_experts, self.max_experts = initial_experts, max_experts
        self.every_n_epochs, self.every_n_steps = every_n_epochs, every_n_steps
        self.noise = check_nonnegative(noise, "noise", "Mitosis", where)
        self.seed = seed
        self.memory_report: list[dict[str, float]] = []

    def target_experts(self, epoch: int, step: int) -> int:
        doublings = epoch // self.every_n_epochs if self.every_n_epochs else step // self.every_n_steps
        return min(self.max_experts, self.initial_experts * 2**doublings)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "Mitosis")
        K = head.num_experts
        if K < self.initial_experts or K > self.max_experts or not math.log2(K / self.initial_experts).is_integer():
            raise ValueError(
                f"Mitosis expects the head to have initial_experts={self.initial_experts} experts (or a doubling "
                f"of it up to {self.max_experts}), got num_experts={K} (set head.init_args.num_experts to "
                f"{self.initial_experts})"
            )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_n_epochs:
            self._grow(trainer, pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        # Also with every_n_epochs: Lightning 2.6 skips on_train_epoch_start when it resumes
        # inside an epoch or right at its end, and the epoch's target must still be reached
        # before its first step (a no-op when it already is).
        self._grow(trainer, pl_module)

    def _grow(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "Mitosis")
        target = self.target_experts(trainer.current_epoch, trainer.global_step)
        while head.num_experts < target:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + head.num_experts)
            apply_structure_change(trainer, head.split_experts(self.noise, generator))
            row = {
                "epoch": float(trainer.current_epoch),
                "step": float(trainer.global_step),
                "num_experts": float(head.num_experts),
                "kept_rows": float(head.rows_per_expert().sum()),
                "head_param_bytes": float(head.memory_bytes()),
                "head_optimizer_bytes": float(optimizer_bytes(trainer, head)),
            }
            self.memory_report.append(row)
            _log_metrics(trainer, {f"mitosis/{k}": v for k, v in row.items() if k not in ("epoch", "step")})
            rank_zero_info(f"Mitosis: {head.num_experts} experts, head memory {row['head_param_bytes'] / 2**20:.2f} MiB "
                           f"+ optimizer {row['head_optimizer_bytes'] / 2**20:.2f} MiB")

    def state_dict(self) -> dict[str, Any]:
        return {"memory_report": self.memory_report}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.memory_report = list(state_dict.get("memory_report", []))


REFIT_MODES = (None, "rows", "head")


class GroupLassoPruning(Callback):
    """Prune rows with ``||W^e_(c,k)||_2 < threshold`` (Eq. 4; Algorithm 1, lines 7-9).

    Pruning is active once the monitored task loss is below ``loss_below`` or from
    ``start_epoch`` (whichever is set; both: either suffices), and is applied every
    ``every_n_steps`` optimizer steps. A class's last kept row is never removed (the head's
    ``keep_last_copy``). The group-lasso strength λ is a head argument; ``lasso_weight``
    replaces it for epochs ``lasso_from_epoch <= epoch < lasso_until_epoch`` (a function of the
    epoch, so a resumed run gets the same schedule): a pruning phase, after which the head's own
    λ returns and pruning slows down. A λ small enough for the first epochs of learning can be
    far too small to drive any row below γ later: with balanced classes (character recognition)
    λ 1e-4 left 99.5 % of the rows after 700 pruning steps, while λ 1e-3 from epoch 2 pruned to
    16 % within 600 steps (docs/hanzi.md).

    Args:
        threshold: γ, the row-norm threshold.
        start_epoch: first epoch at which pruning is active.
        loss_below: prune once ``monitor`` is below this value.
        monitor: logged metric holding the task loss.
        every_n_steps: steps between two pruning passes.
        lasso_weight: the head's ``group_lasso_weight`` from ``lasso_from_epoch`` on (None:
            leave the head's value alone).
        lasso_from_epoch: first epoch with ``lasso_weight``.
        lasso_until_epoch: first epoch after the pruning phase (None: ``lasso_weight`` to the end).
        rewind: at the end of the pruning phase, keep the structure it found and the gate it
            trained, but give every other weight (the encoder, the kept expert rows, the class
            bias) and its optimizer state the value it had when the phase began. Not in the
            paper. The phase then selects rows and routing; what the lasso epoch did to the
            encoder and the kept rows is undone. Measured on the 100x100 hierarchy
            (docs/ds_softmax.md): after a lasso epoch the model scored 88.7 %; rewound this
            way 94.3 %; with the gate rewound too 93.6 %. Needs ``lasso_weight`` and
            ``lasso_until_epoch``, and no mitosis during the phase. The snapshot is part of this
            callback's checkpoint state while the phase runs (a checkpoint written then holds
            the module's weights twice). The head leaves pruned classes out of its softmax from
            the rewind on (``DSSoftmax.rewind_rows``). Training everything on after the rewind
            lost accuracy in every variant measured: end the run with the phase, or use
            ``refit``.
        refit: what trains after the rewind, for the remaining epochs (None: everything).
            ``"head"``: the head alone (expert rows, class bias, gate); ``"rows"``: the kept
            expert rows and the class bias. The rest is frozen (``requires_grad`` off, the DDP
            wrapper rebuilt), so the encoder's features, which the structure was selected on,
            stay as they are. Needs ``rewind``. Not in the paper. On the 100x100 hierarchy one
            such epoch (``"head"``, lr 3.3e-4, balancing off: ``LoadBalancing(until_epoch)``)
            took the rewound model from 94.3 % to 95.3 %, where training everything lost
            accuracy (docs/ds_softmax.md). Frozen modules stay in train mode (dropout and
            batch-norm statistics behave as in training).
        refit_until_epoch: first epoch at which everything trains again after the ``refit``
            (None: the refit lasts to the end; the parameters the refit froze train again, with
            the optimizer state they had). Not in the paper. On the language model two such
            epochs after the head's refit added 0.3-0.9 pt to DS-16 and DS-64, about what a
            softmax gains from the same encoder epochs at that rate (docs/ds_softmax.md,
            "Refit, then everything").
    """

    def __init__(
        self,
        threshold: float = 1e-3,
        start_epoch: int | None = 1,
        loss_below: float | None = None,
        monitor: str = "train/task_loss",
        every_n_steps: int = 50,
        lasso_weight: float | None = None,
        lasso_from_epoch: int = 0,
        lasso_until_epoch: int | None = None,
        rewind: bool = False,
        refit: str | None = None,
        refit_until_epoch: int | None = None,
    ) -> None:
        super().__init__()
        where = "trainer.callbacks.GroupLassoPruning.init_args"
        if rewind and (lasso_weight is None or lasso_until_epoch is None):
            raise ValueError(
                f"GroupLassoPruning rewind=True needs a bounded pruning phase, got lasso_weight={lasso_weight} and "
                f"lasso_until_epoch={lasso_until_epoch} (set both in {where}, or rewind: false)"
            )
        self.rewind = bool(rewind)
        if refit not in REFIT_MODES:
            raise ValueError(f"GroupLassoPruning needs refit in {REFIT_MODES}, got {refit!r} (set {where}.refit)")
        if refit is not None and not rewind:
            raise ValueError(f"GroupLassoPruning refit={refit!r} needs rewind=True, got rewind={rewind} "
                             f"(set {where}.rewind: true, or refit: null)")
        self.refit = refit
        if refit_until_epoch is not None and (refit is None or refit_until_epoch <= lasso_until_epoch):
            raise ValueError(
                f"GroupLassoPruning refit_until_epoch={refit_until_epoch} needs a refit that starts before it (refit "
                f"{refit!r} from lasso_until_epoch={lasso_until_epoch}); set {where}.refit and a later refit_until_epoch, "
                f"or refit_until_epoch: null")
        self.refit_until_epoch = refit_until_epoch
        #: Names of the module parameters that train after the rewind (``refit``).
        self.refit_params: list[str] | None = None
        #: Module parameters and optimizer state at the start of the pruning phase (rewind only).
        self.snapshot: dict[str, Any] | None = None
        self.rewound = False
        self.threshold = check_nonnegative(threshold, "threshold", "GroupLassoPruning", where)
        if lasso_weight is not None:
            check_nonnegative(lasso_weight, "lasso_weight", "GroupLassoPruning", where)
        if lasso_from_epoch < 0:
            raise ValueError(f"GroupLassoPruning needs lasso_from_epoch >= 0, got {lasso_from_epoch} (set {where}.lasso_from_epoch)")
        if lasso_until_epoch is not None and lasso_until_epoch <= lasso_from_epoch:
            raise ValueError(
                f"GroupLassoPruning needs lasso_until_epoch > lasso_from_epoch ({lasso_from_epoch}), got {lasso_until_epoch}"
                f" (set {where}.lasso_until_epoch later, or null for no end)")
        self.lasso_weight, self.lasso_from_epoch = lasso_weight, lasso_from_epoch
        self.lasso_until_epoch = lasso_until_epoch
        self._initial_lasso_weight: float | None = None
        if start_epoch is None and loss_below is None:
            raise ValueError(f"GroupLassoPruning needs start_epoch or loss_below, got neither (set {where}.start_epoch)")
        if every_n_steps < 1:
            raise ValueError(f"GroupLassoPruning needs every_n_steps >= 1, got {every_n_steps} (set {where}.every_n_steps)")
        self.start_epoch, self.loss_below, self.monitor = start_epoch, loss_below, monitor
        self.every_n_steps = every_n_steps
        self.pruned_rows = 0
        #: The monitored loss as last seen; a resumed run uses it until the metric is logged
        #: again (Lightning does not restore ``callback_metrics``, e.g. an older ``val/loss``).
        self.last_monitored: float | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "GroupLassoPruning")
        self._initial_lasso_weight = head.group_lasso_weight

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._freeze_for_refit(trainer, pl_module)  # requires_grad is not in a checkpoint: a resumed run starts unfrozen

    def _freeze_for_refit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After the rewind, with ``refit``: freeze all but ``refit_params`` (again after pruning
        re-allocated parameters)."""
        if self.refit is None or not self.rewound:
            return
        if self.refit_until_epoch is not None and trainer.current_epoch >= self.refit_until_epoch:
            if _train_only(trainer, pl_module, [name for name, _ in pl_module.named_parameters()]):
                rank_zero_info(f"GroupLassoPruning: refit over at epoch {trainer.current_epoch}, everything trains again")
            return
        if self.refit_params is None:
            raise ValueError("GroupLassoPruning refit: the checkpoint was written after a rewind without refit, so it "
                             "does not name the parameters to refit (resume with refit: null, or from inside the phase)")
        _train_only(trainer, pl_module, self.refit_params)

    def lasso_weight_at(self, epoch: int) -> float | None:
        """The head's λ at ``epoch`` (None before fit has seen the head)."""
        until = self.lasso_until_epoch
        if self.lasso_weight is not None and self.lasso_from_epoch <= epoch and (until is None or epoch < until):
            return self.lasso_weight
        return self._initial_lasso_weight

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        weight = self.lasso_weight_at(trainer.current_epoch)
        if weight is not None:
            sparse_experts(pl_module, "GroupLassoPruning").group_lasso_weight = weight
        self._freeze_for_refit(trainer, pl_module)  # the refit may end with this epoch (refit_until_epoch)

    def _see_monitor(self, trainer: pl.Trainer) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None:
            self.last_monitored = float(value)

    def active(self, trainer: pl.Trainer) -> bool:
        if self.start_epoch is not None and trainer.current_epoch >= self.start_epoch:
            return True
        self._see_monitor(trainer)
        return self.loss_below is not None and self.last_monitored is not None and self.last_monitored < self.loss_below

    # A checkpoint can be written after validation or at the epoch end, where the monitored
    # value may have changed since the last batch: record it first (ModelCheckpoint runs last).
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._see_monitor(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._see_monitor(trainer)
        if self.rewind and self.snapshot is not None and trainer.current_epoch >= self.lasso_until_epoch - 1:
            # The last batch was not recognised (a loader without a length): rewind now; this
            # epoch's validation, if any, saw the weights before the rewind.
            rank_zero_warn("GroupLassoPruning: rewinding at the epoch end, after this epoch's validation "
                           "(the train loader has no length; set limit_train_batches to rewind before it)")
            self._finish_phase(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        state = {"pruned_rows": self.pruned_rows, "last_monitored": self.last_monitored}
        if self.rewind:
            state.update(snapshot=self.snapshot, rewound=self.rewound, refit_params=self.refit_params)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pruned_rows = int(state_dict.get("pruned_rows", 0))
        self.last_monitored = state_dict.get("last_monitored")
        self.snapshot = state_dict.get("snapshot")
        self.rewound = bool(state_dict.get("rewound", False))
        self.refit_params = state_dict.get("refit_params")

    def _in_phase(self, epoch: int) -> bool:
        return self.lasso_from_epoch <= epoch < self.lasso_until_epoch

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        # Per batch, not per epoch: Lightning skips on_train_epoch_start on some resumes.
        if self.rewind and self.snapshot is None and not self.rewound and self._in_phase(trainer.current_epoch):
            self.snapshot = _take_snapshot(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        last_of_phase = (
            self.rewind and self.snapshot is not None and trainer.current_epoch == self.lasso_until_epoch - 1
            and batch_idx + 1 >= trainer.num_training_batches
        )
        if trainer.global_step % self.every_n_steps == 0 and self.active(trainer):
            self._prune(trainer, pl_module)
        if last_of_phase:
            self._finish_phase(trainer, pl_module)

    def _finish_phase(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A last pruning pass, then the rewind (``rewind=True``)."""
        if self.active(trainer):
            self._prune(trainer, pl_module)
        rewound = _rewind(trainer, pl_module, self.snapshot)
        self.snapshot, self.rewound = None, True
        rank_zero_info(f"GroupLassoPruning: pruning phase over, kept weights rewound to epoch {self.lasso_from_epoch}'s start")
        if self.refit is not None:
            head = sparse_experts(pl_module, "GroupLassoPruning")
            prefix = _prefix_of(pl_module, head)
            self.refit_params = rewound if self.refit == "rows" else sorted(prefix + n for n, _ in head.named_parameters())
            self._freeze_for_refit(trainer, pl_module)
            rank_zero_info(f"GroupLassoPruning: from now on only {', '.join(self.refit_params)} train")

    def _prune(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "GroupLassoPruning")
        before = int(head.rows_per_expert().sum())
        apply_structure_change(trainer, head.prune(self.threshold))
        self.pruned_rows += before - int(head.rows_per_expert().sum())
        self._freeze_for_refit(trainer, pl_module)  # pruning re-allocates parameters, trainable


def _take_snapshot(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """CPU copies of the module's state and, per optimizer, each parameter's state by name."""
    names = {id(p): n for n, p in pl_module.named_parameters()}
    optim = []
    for optimizer in trainer.optimizers:
        optim.append({
            names[id(p)]: {k: v.detach().cpu().clone() if isinstance(v, Tensor) else v for k, v in state.items()}
            for p, state in optimizer.state.items() if id(p) in names
        })
    module = {n: t.detach().cpu().clone() for n, t in pl_module.state_dict().items()}
    return {"module": module, "optimizers": optim}


def _prefix_of(pl_module: torch.nn.Module, head: torch.nn.Module) -> str:
    """``"<name>."`` of ``head`` inside ``pl_module`` (``""`` if it is the module itself)."""
    name = next(n for n, m in pl_module.named_modules() if m is head)
    return f"{name}." if name else ""


def _train_only(trainer: pl.Trainer, pl_module: pl.LightningModule, names: list[str]) -> bool:
    """Freeze every parameter of the module but ``names``; rebuild DDP if that changed anything
    (and say so)."""
    changed = False
    for name, param in pl_module.named_parameters():
        trainable = name in names
        if param.requires_grad != trainable:
            param.requires_grad_(trainable)
            changed = True
    if changed:
        _rebuild_ddp(trainer)
    return changed


@torch.no_grad()
def _rewind(trainer: pl.Trainer, pl_module: pl.LightningModule, snapshot: dict[str, Any]) -> list[str]:
    """Give the module's parameters and their optimizer state the snapshot's values, rows of the
    sparse-experts head matched by (expert, class) so the pruned structure stays; the head's
    parameters it does not rewind (the gate) keep theirs. Returns the names of the head's
    rewound parameters."""
    head = sparse_experts(pl_module, "GroupLassoPruning")
    prefix = _prefix_of(pl_module, head)
    module = snapshot["module"]
    row_sources = {prefix + n: rows for n, rows in head.rewind_rows(
        {n[len(prefix):]: t for n, t in module.items() if n.startswith(prefix)}).items()}
    head_params = {prefix + n for n, _ in head.named_parameters()}
    params = {n: p for n, p in pl_module.named_parameters() if n not in head_params or n in row_sources}
    for name, param in params.items():
        if name not in head_params:
            if module[name].shape != param.shape:
                raise ValueError(f"GroupLassoPruning rewind: {name} changed shape during the pruning phase "
                                 f"({tuple(module[name].shape)} -> {tuple(param.shape)}); only head rows may be pruned")
            param.copy_(module[name].to(param))
    ids = {id(p): n for n, p in params.items()}
    for optimizer, saved in zip(trainer.optimizers, snapshot["optimizers"]):
        for param in list(optimizer.state):
            name = ids.get(id(param))
            if name is None or name not in saved:
                continue
            current, state, rows = optimizer.state[param], saved[name], row_sources.get(name)  # rows: None = whole tensor
            if rows is not None:
                state = _remap_state(state, module[name].shape[0], rows)
            optimizer.state[param] = {
                key: value.to(current[key].device if key in current else param.device) if isinstance(value, Tensor) else value
                for key, value in state.items()
            }
    return sorted(row_sources)


class LoadBalancing(_EpochAccumulator):
    """Schedule λ_load (linear warm-up over ``warmup_epochs``, 0 from ``until_epoch`` on) and log
    balance statistics.

    ``until_epoch`` ends the balancing, e.g. for a refit of the head after a rewind
    (``GroupLassoPruning(refit="head")``): once the structure is fixed, a balancing loss on a
    trainable gate pulls contexts away from the experts that keep their classes (on the 100x100
    hierarchy a refit epoch with λ_load 1 fell to purity 0.93 and 93.0 % top-1, docs/ds_softmax.md).

    Logs, per epoch, the coefficient of variation of expert *importance* (summed gate
    values, what the loss acts on) and of expert *load* (training contexts routed), both
    summed across ranks.
    """

    def __init__(self, weight: float = 0.01, warmup_epochs: int = 0, until_epoch: int | None = None) -> None:
        super().__init__()
        where = "trainer.callbacks.LoadBalancing.init_args"
        self.weight = check_nonnegative(weight, "weight", "LoadBalancing", where)
        if warmup_epochs < 0:
            raise ValueError(f"LoadBalancing needs warmup_epochs >= 0, got {warmup_epochs} (set {where}.warmup_epochs)")
        if until_epoch is not None and until_epoch < 1:
            raise ValueError(f"LoadBalancing needs until_epoch >= 1 or null, got {until_epoch} (set {where}.until_epoch)")
        self.warmup_epochs, self.until_epoch = warmup_epochs, until_epoch

    def weight_at(self, epoch: int) -> float:
        if self.until_epoch is not None and epoch >= self.until_epoch:
            return 0.0
        if self.warmup_epochs == 0:
            return self.weight
        return self.weight * min(1.0, (epoch + 1) / self.warmup_epochs)

    def _start_epoch(self, trainer: pl.Trainer) -> None:
        head = sparse_experts(trainer.lightning_module, "LoadBalancing")
        head.load_balance_weight = self.weight_at(trainer.current_epoch)
        super()._start_epoch(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_epoch(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._accumulate(sparse_experts(pl_module, "LoadBalancing"))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "LoadBalancing")
        metrics = {"balance/load_balance_weight": head.load_balance_weight}
        own = self._load if self._load is not None else torch.zeros(head.num_experts)
        load = _reduce_sum(trainer, own)
        if load.sum() > 0:
            metrics["balance/cv_load"] = float(load.std(unbiased=False) / load.mean())
        if self._importance is not None:
            importance = _reduce_sum(trainer, self._importance)
            metrics["balance/cv_importance"] = float(importance.std(unbiased=False) / importance.mean().clamp_min(1e-12))
        _log_metrics(trainer, metrics)


class RoutingLoss(Callback):
    """Schedule the head's routing-loss weight λ_route (``DSSoftmax.routing_loss_weight``, not in
    the paper): 0 before ``from_epoch``, ``weight`` from it on; the head's own value is replaced.

    The routing loss teaches the gate to send a context to an expert that keeps its target.
    Switched on during the pruning phase it changes what gets pruned; started at a later refit
    epoch it only moves the routing over a fixed structure. On the DS-64 language model the
    second kept more of the FLOPs reduction for the same coverage (docs/ds_softmax.md, "Routing
    loss"). A function of the epoch, so a resumed run gets the same schedule.
    """

    def __init__(self, weight: float = 1.0, from_epoch: int = 0) -> None:
        super().__init__()
        where = "trainer.callbacks.RoutingLoss.init_args"
        self.weight = check_nonnegative(weight, "weight", "RoutingLoss", where)
        if from_epoch < 0:
            raise ValueError(f"RoutingLoss needs from_epoch >= 0, got {from_epoch} (set {where}.from_epoch)")
        self.from_epoch = from_epoch

    def weight_at(self, epoch: int) -> float:
        return self.weight if epoch >= self.from_epoch else 0.0

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "RoutingLoss")
        if not hasattr(head, "routing_loss_weight"):
            raise TypeError(f"RoutingLoss needs a head with a routing loss (routing_loss_weight), got {type(head).__name__}; "
                            "use heads.DSSoftmax or remove the callback")
        head.routing_loss_weight = self.weight_at(trainer.current_epoch)

    # on_train_start too: Lightning skips on_train_epoch_start on some resumes.
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, pl_module)


class SparsityTracker(_EpochAccumulator):
    """Per-epoch sparsity, utilisation and cost of the sparse experts, to the loggers.

    Scalars: mean kept fraction, theoretical speed-up ``1 / Σ_k u_k f_k`` (``u_k`` share of
    the epoch's training contexts routed to expert k, ``f_k`` its kept fraction of the vocabulary), FLOPs reduction
    ``V / (K + Σ_k u_k n_k)`` (full softmax: ``V·d`` multiply-adds per context; DS: gate ``K·d``
    plus the chosen expert's ``n_k·d``), head memory. TensorBoard also gets histograms of
    per-expert sparsity, utilisation and redundancy (experts keeping each class) and an
    expert x class heatmap, classes ordered by the datamodule's ``super_class_of`` when it
    has one (else by class id, i.e. frequency order). At the end of training the class lists
    of the ``num_smallest`` smallest experts (App. C) are written to the log directory and
    kept in :attr:`smallest_experts`.
    """

    def __init__(self, heatmap: bool = True, num_smallest: int = 3, max_listed: int = 50) -> None:
        super().__init__()
        self.heatmap, self.num_smallest, self.max_listed = heatmap, num_smallest, max_listed
        self.last: dict[str, float] = {}
        self.smallest_experts: list[dict[str, Any]] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sparse_experts(pl_module, "SparsityTracker")
        self._start_epoch(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._accumulate(sparse_experts(pl_module, "SparsityTracker"))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last": dict(self.last), "smallest_experts": list(self.smallest_experts)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.last = dict(state_dict.get("last", {}))
        self.smallest_experts = list(state_dict.get("smallest_experts", []))

    def summarize(self, head: SparseExperts, counts: Tensor) -> dict[str, Any]:
        rows = head.rows_per_expert().float().cpu()  # (K,)
        V, K = head.num_classes, head.num_experts
        kept_fraction = rows / V
        utilisation = counts / counts.sum() if counts.sum() > 0 else torch.full((K,), 1.0 / K)
        mask = head.kept_mask().cpu()
        return {
            "scalars": {
                "sparsity/num_experts": float(K),
                "sparsity/kept_fraction": float(rows.sum() / (K * V)),
                "sparsity/theoretical_speedup": speedup(utilisation, kept_fraction),
                "sparsity/flops_reduction": V / (K + float((utilisation * rows).sum())),
                "sparsity/mean_redundancy": float(mask.sum(0).float().mean()),
                "sparsity/head_memory_mib": head.memory_bytes() / 2**20,
            },
            "per_expert_sparsity": 1.0 - kept_fraction,
            "utilisation": utilisation,
            "redundancy": mask.sum(0),
            "mask": mask,
        }

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "SparsityTracker")
        own = self._load if self._load is not None else torch.zeros(head.num_experts)
        summary = self.summarize(head, _reduce_sum(trainer, own))
        self.last = summary["scalars"]
        _log_metrics(trainer, self.last)
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if not isinstance(logger, TensorBoardLogger):
                continue
            writer, step = logger.experiment, trainer.current_epoch
            writer.add_histogram("sparsity/per_expert_sparsity", summary["per_expert_sparsity"], step)
            writer.add_histogram("sparsity/utilisation", summary["utilisation"], step)
            writer.add_histogram("sparsity/redundancy", summary["redundancy"].float(), step)
            if self.heatmap:
                writer.add_image("sparsity/expert_class_heatmap", self.heatmap_image(summary["mask"], trainer), step, dataformats="HW")

    @staticmethod
    def class_order(num_classes: int, trainer: pl.Trainer | None) -> Tensor:
        """Classes grouped by ground-truth super-class when the data knows it, else by id."""
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        super_class_of = getattr(datamodule, "super_class_of", None)
        if super_class_of is None:
            return torch.arange(num_classes)
        return torch.argsort(torch.as_tensor(super_class_of), stable=True)

    def heatmap_image(self, mask: Tensor, trainer: pl.Trainer | None) -> Tensor:
        """``(K, V)`` kept-mask image in [0, 1], columns in :meth:`class_order`."""
        return mask[:, self.class_order(mask.shape[1], trainer)].float()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "SparsityTracker")
        mask = head.kept_mask().cpu()
        names = class_names(getattr(trainer, "datamodule", None), head.num_classes)
        order = torch.argsort(mask.sum(1), stable=True)[: self.num_smallest]
        self.smallest_experts = [
            {"expert": int(k), "num_classes": int(mask[k].sum()),
             "classes": [names[c] for c in mask[k].nonzero().squeeze(1).tolist()[: self.max_listed]]}
            for k in order.tolist()
        ]
        log_dir = trainer.log_dir
        if trainer.is_global_zero and log_dir:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, "smallest_experts.txt"), "w", encoding="utf-8") as f:
                for entry in self.smallest_experts:
                    f.write(f"expert {entry['expert']} ({entry['num_classes']} classes): {' '.join(entry['classes'])}\n")


def class_names(datamodule: Any, num_classes: int) -> list[str]:
    """Readable class names from the datamodule (``class_names`` or a vocabulary), else ids."""
    names = getattr(datamodule, "class_names", None)
    if names is None:
        vocab = getattr(datamodule, "vocabulary", None) or getattr(datamodule, "vocab", None)
        itos = getattr(vocab, "itos", None) or getattr(vocab, "tokens", None)
        names = list(itos) if itos is not None else None
    if names is None or len(names) < num_classes:
        return [str(c) for c in range(num_classes)]
    return [str(n) for n in names]
