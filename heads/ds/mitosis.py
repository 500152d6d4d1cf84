"""Mitosis (App. B of Liao et al.): grow the experts of a DS-Softmax head by cloning."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from heads.ds.accumulator import log_metrics, sparse_experts
from heads.ds.surgery import apply_structure_change, optimizer_bytes
from heads.validation import check_nonnegative

WHERE = "trainer.callbacks.Mitosis.init_args"


class Mitosis(Callback):
    """Grow the experts by cloning (App. B): ``K0 -> 2 K0 -> ... -> max_experts``.

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
        initial_experts: removed; the head's ``num_experts`` is ``K0``. Giving it is an error
            that says so (configs written before it moved to the head would otherwise
            disagree with the head silently).
    """

    def __init__(
        self,
        max_experts: int = 64,
        every_n_epochs: int | None = 1,
        every_n_steps: int | None = None,
        noise: float = 0.01,
        seed: int = 0,
        initial_experts: int | None = None,
    ) -> None:
        super().__init__()
        if initial_experts is not None:
            raise ValueError(
                f"Mitosis no longer takes initial_experts (got {initial_experts}): it starts from the head's num_experts "
                f"(remove {WHERE}.initial_experts and set model.init_args.head.init_args.num_experts to {initial_experts})"
            )
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
        self.memory_report: list[dict[str, float]] = []

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

    def target_experts(self, epoch: int, step: int, initial_experts: int) -> int:
        """Experts the head has at ``epoch`` / global ``step`` when it started with ``initial_experts``."""
        doublings = epoch // self.every_n_epochs if self.every_n_epochs else step // self.every_n_steps
        return min(self.max_experts, initial_experts * 2**doublings)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check_start(sparse_experts(pl_module, "Mitosis").initial_experts)

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
            log_metrics(trainer, {f"mitosis/{k}": v for k, v in row.items() if k not in ("epoch", "step")})
            rank_zero_info(f"Mitosis: {head.num_experts} experts, head memory {row['head_param_bytes'] / 2**20:.2f} MiB "
                           f"+ optimizer {row['head_optimizer_bytes'] / 2**20:.2f} MiB")

    def state_dict(self) -> dict[str, Any]:
        return {"memory_report": self.memory_report}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.memory_report = list(state_dict.get("memory_report", []))
