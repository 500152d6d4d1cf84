"""Mitosis (§2 and App. B of Liao et al.): grow the experts of a DS-Softmax head by cloning,
stage by stage, and measure the head's training memory as it grows."""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from datamodules.files import write_atomically
from heads.ds.memory import plot_memory, png_to_chw, training_memory
from heads.validation import check_nonnegative
from tasks.callbacks.common import DS_GROUP, log_metrics, sparse_experts
from tasks.callbacks.surgery import apply_structure_change

WHERE = "trainer.callbacks.Mitosis.init_args"
PLOT_NAME = "mitosis_memory.png"


def shortened(trainer: pl.Trainer) -> bool:
    """A run cut short on purpose (``fast_dev_run``, ``limit_train_batches``): schedule checks
    warn instead of refusing it."""
    limit = trainer.limit_train_batches
    # an int is a number of batches (1: one batch an epoch), a float a fraction (1.0: all of them)
    return bool(trainer.fast_dev_run) or (limit is not None and (isinstance(limit, int) or limit != 1.0))


def shortened_by(trainer: pl.Trainer, unit: str) -> str:
    """What ends a :func:`shortened` run before the schedule, named for the warning: the
    ``fast_dev_run``; for a schedule in epochs, ``max_epochs`` (``limit_train_batches`` shortens
    the epochs, not their number); in steps, ``max_steps`` when it ends the run, else
    ``limit_train_batches`` when it leaves out batches of an epoch, else ``max_epochs``."""
    if trainer.fast_dev_run:
        return "trainer.fast_dev_run"
    limit = trainer.limit_train_batches
    trial = f" (in a trial run with trainer.limit_train_batches={limit})"
    if unit == "steps":
        if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.max_steps == trainer.estimated_stepping_batches:
            return f"trainer.max_steps={trainer.max_steps}{trial}"
        used, loader = trainer.num_training_batches, trainer.train_dataloader
        try:  # the batches of an epoch without the limit (several loaders, or none with a length: unknown)
            batches = len(loader) if isinstance(loader, torch.utils.data.DataLoader) else math.inf
        except TypeError:
            batches = math.inf
        if used < batches:
            of = f"{int(used)} of {batches} batches an epoch" if math.isfinite(batches) else f"{int(used)} batches an epoch"
            return f"trainer.limit_train_batches={limit} ({of})"
    return f"trainer.max_epochs={trainer.max_epochs}{trial}"


def run_length(trainer: pl.Trainer, unit: str) -> float:
    """Epochs (``unit="epochs"``) or optimizer steps (``"steps"``) the run will train
    (``inf`` when unbounded)."""
    if unit == "epochs":
        epochs = trainer.max_epochs
        return math.inf if epochs is None or epochs < 0 else float(epochs)
    return float(trainer.estimated_stepping_batches)


class Mitosis(Callback):
    """Grow the experts by cloning (§2, Fig. 2, App. B): ``K0 -> 2 K0 -> ... -> max_experts``.

    Training runs in stages: a cloning starts a stage, the stage trains (Algorithm 1) and, with
    ``GroupLassoPruning(after_cloning=P)``, prunes from ``P`` epochs (or steps) after its start,
    so the next cloning copies each expert's *kept* rows only (:meth:`DSSoftmax.clone_experts`)
    and the sparsity is inherited: no pruned row comes back. App. B clones every 15 epochs and
    starts pruning 10 epochs after each cloning.

    Memory: after every optimizer step and after each cloning the head's parameter, gradient
    and optimizer-state bytes (:func:`heads.ds.memory.training_memory`) and their ratio to a
    full softmax of the same ``V`` and ``d`` are logged (``~ds/mitosis/head_memory_bytes``,
    ``~ds/mitosis/head_memory_ratio``); :attr:`peak_ratio` is the peak over the run and
    :attr:`memory_report` the value at each cloning. At the end of fitting the ratio against
    the step, clonings marked (Fig. 6a), is written to ``<log dir>/mitosis_memory.png`` and to
    TensorBoard (``~ds/mitosis/memory``).

    ``K0`` is the head's own ``num_experts`` argument (``head.init_args.num_experts``, kept by the
    head as ``initial_experts``): the head is the one place that says how many experts training
    starts with. The schedule is a function of the epoch (or global step), so a resumed run
    continues it: at epoch ``e`` the head has ``min(max_experts, K0 * 2 ** (e // every_n_epochs))``
    experts. Cloning happens at the start of an epoch (or before a step), outside any
    forward/backward pass. After each cloning the head's parameter and optimizer memory is
    recorded in :attr:`memory_report` and logged.

    Args:
        max_experts: ``K_max``; must be the head's ``num_experts`` times a power of two
            (checked when fitting starts).
        every_n_epochs: epochs between two cloning steps (exclusive with ``every_n_steps``).
        every_n_steps: optimizer steps between two cloning steps.
        noise: relative noise added to the clones (see ``DSSoftmax.split_experts``).
        seed: seed of the clone noise; identical on every rank.
        plot: write the memory figure at the end of fitting.

    A schedule whose last cloning falls after the end of the run (``max_epochs``, or the
    steps it amounts to) is refused when training starts; a run shortened on purpose
    (``fast_dev_run``, ``limit_train_batches``) only gets a warning.
    """

    def __init__(
        self,
        max_experts: int = 64,
        every_n_epochs: int | None = 1,
        every_n_steps: int | None = None,
        noise: float = 0.01,
        seed: int = 0,
        plot: bool = True,
    ) -> None:
        super().__init__()
        if max_experts < 1:
            raise ValueError(f"Mitosis needs max_experts >= 1, got {max_experts} (set {WHERE}.max_experts)")
        if (every_n_epochs is None) == (every_n_steps is None):
            raise ValueError(
                f"Mitosis needs exactly one of every_n_epochs / every_n_steps, got {every_n_epochs} / "
                f"{every_n_steps} (set the other one to null in {WHERE})"
            )
        for key, value in (("every_n_epochs", every_n_epochs), ("every_n_steps", every_n_steps)):
            if value is not None and value < 1:
                raise ValueError(f"Mitosis needs {key} >= 1, got {value} (set {WHERE}.{key})")
        self.max_experts = max_experts
        self.every_n_epochs, self.every_n_steps = every_n_epochs, every_n_steps
        self.noise = check_nonnegative(noise, "noise", "Mitosis", WHERE)
        self.seed = seed
        self.plot = bool(plot)
        self.memory_report: list[dict[str, float]] = []
        #: Per optimizer step: ``[global step, memory ratio]``.
        self.memory_history: list[list[float]] = []
        self.peak_ratio = 0.0
        self.peak_bytes = 0.0

    def check_start(self, initial_experts: int) -> None:
        """Refuse a ``max_experts`` that doubling cannot reach from the head's ``initial_experts``."""
        K, ratio = initial_experts, self.max_experts / initial_experts
        if self.max_experts < K or self.max_experts % K or not math.log2(ratio).is_integer():
            doublings = max(0, round(math.log2(max(ratio, 1))))
            halvings = [self.max_experts >> j for j in range(self.max_experts.bit_length()) if self.max_experts % 2**j == 0]
            start = min(halvings, key=lambda k: (abs(k - K), k))
            raise ValueError(
                f"Mitosis needs max_experts reachable from the head's num_experts by doubling, got num_experts={K} "
                f"and max_experts={self.max_experts} (set {WHERE}.max_experts to {K * 2**doublings}, "
                f"or model.init_args.head.init_args.num_experts to {start})"
            )

    @property
    def unit(self) -> str:
        """``"epochs"`` or ``"steps"``: what ``every_n_*`` (and a pruning ``after_cloning``) count."""
        return "epochs" if self.every_n_epochs else "steps"

    @property
    def period(self) -> int:
        return self.every_n_epochs or self.every_n_steps

    def clonings(self, initial_experts: int) -> int:
        """Cloning steps from ``initial_experts`` to ``max_experts``."""
        return max(0, round(math.log2(self.max_experts / initial_experts)))

    def last_cloning(self, initial_experts: int) -> int:
        """Epoch (or step) of the last cloning; 0 when there is none."""
        return self.clonings(initial_experts) * self.period

    def target_experts(self, epoch: int, step: int, initial_experts: int) -> int:
        """Experts the head has at ``epoch`` / global ``step`` when it started with ``initial_experts``."""
        doublings = epoch // self.every_n_epochs if self.every_n_epochs else step // self.every_n_steps
        return min(self.max_experts, initial_experts * 2**doublings)

    def stage_position(self, epoch: int, step: int, initial_experts: int) -> int:
        """Epochs (or steps) since the start of the current stage: since the last cloning, or
        since the start of training before the first; the last stage runs to the end."""
        now = epoch if self.every_n_epochs else step
        stage = min(now // self.period, self.clonings(initial_experts))
        return now - stage * self.period

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check_start(sparse_experts(pl_module, "Mitosis").initial_experts)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check_reachable(trainer, sparse_experts(pl_module, "Mitosis").initial_experts)

    def check_reachable(self, trainer: pl.Trainer, initial_experts: int) -> None:
        """Refuse a schedule whose last cloning comes after the run ends (warn for a shortened run)."""
        n, last = self.clonings(initial_experts), self.last_cloning(initial_experts)
        total = run_length(trainer, self.unit)
        if n == 0 or last < total:
            return
        key = f"every_n_{self.unit}"
        fastest = int(total - 1) // n if math.isfinite(total) else self.period
        if self.unit == "epochs":
            needed = f"trainer.max_epochs to at least {last + 1}"
        elif trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.max_steps == total:
            needed = f"trainer.max_steps to at least {last + 1}"
        else:
            per_epoch = total / max(trainer.max_epochs or 1, 1)
            needed = f"trainer.max_epochs to at least {math.ceil((last + 1) / max(per_epoch, 1))}"
        message = (
            f"Mitosis cannot reach max_experts={self.max_experts} from the head's num_experts={initial_experts} "
            f"within the run: {n} clonings every {self.period} {self.unit} put the last at {self.unit[:-1]} {last}, "
            f"but the run has {int(total)} {self.unit} (set {needed}, or {WHERE}.{key} to at most {max(fastest, 1)})"
        )
        if shortened(trainer):
            rank_zero_warn(f"{message}; the run is shortened by {shortened_by(trainer, self.unit)}, so it goes on")
            return
        raise ValueError(message)

    # ------------------------------------------------------------------ memory
    def _measure(self, trainer: pl.Trainer, head: Any) -> dict[str, float]:
        memory = training_memory(head, trainer.optimizers)
        if memory["ratio"] > self.peak_ratio:
            self.peak_ratio, self.peak_bytes = memory["ratio"], memory["bytes"]
        return memory

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        memory = self._measure(trainer, sparse_experts(pl_module, "Mitosis"))
        self.memory_history.append([float(trainer.global_step), memory["ratio"]])
        log_metrics(trainer, {f"{DS_GROUP}/mitosis/head_memory_bytes": memory["bytes"], f"{DS_GROUP}/mitosis/head_memory_ratio": memory["ratio"],
                              f"{DS_GROUP}/mitosis/peak_memory_ratio": self.peak_ratio})

    def memory_figure(self) -> bytes:
        """PNG of the memory ratio against the step, clonings marked (Fig. 6a)."""
        steps = [row[0] for row in self.memory_history]
        ratios = [row[1] for row in self.memory_history]
        return plot_memory(steps, ratios, self.memory_report)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.plot:
            return
        log_dir = trainer.log_dir  # a broadcast under DDP: every rank takes part
        if not (trainer.is_global_zero and self.memory_history):
            return
        png = self.memory_figure()
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            write_atomically(os.path.join(log_dir, PLOT_NAME), png, what="mitosis memory figure")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image(f"{DS_GROUP}/mitosis/memory", png_to_chw(png), trainer.global_step)

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
        target = self.target_experts(trainer.current_epoch, trainer.global_step, head.initial_experts)
        while head.num_experts < target:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + head.num_experts)
            apply_structure_change(trainer, head.clone_experts(self.noise, generator))
            memory = self._measure(trainer, head)
            row = {
                "epoch": float(trainer.current_epoch),
                "step": float(trainer.global_step),
                "num_experts": float(head.num_experts),
                "kept_rows": float(head.rows_per_expert().sum()),
                "head_param_bytes": memory["param_bytes"],
                "head_optimizer_bytes": memory["optimizer_bytes"],
                "head_memory_bytes": memory["bytes"],
                "ratio": memory["ratio"],
            }
            self.memory_report.append(row)
            log_metrics(trainer, {f"{DS_GROUP}/mitosis/{k}": v for k, v in row.items() if k not in ("epoch", "step", "ratio")}
                        | {f"{DS_GROUP}/mitosis/head_memory_ratio": memory["ratio"]})
            rank_zero_info(f"Mitosis: {head.num_experts} experts, {row['kept_rows']:.0f} kept rows, head training memory "
                           f"{memory['bytes'] / 2**20:.2f} MiB = {memory['ratio']:.2f}x a full softmax")

    def state_dict(self) -> dict[str, Any]:
        return {"memory_report": self.memory_report, "memory_history": self.memory_history,
                "peak_ratio": self.peak_ratio, "peak_bytes": self.peak_bytes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.memory_report = list(state_dict.get("memory_report", []))
        self.memory_history = [list(row) for row in state_dict.get("memory_history", [])]
        self.peak_ratio = float(state_dict.get("peak_ratio", 0.0))
        self.peak_bytes = float(state_dict.get("peak_bytes", 0.0))
