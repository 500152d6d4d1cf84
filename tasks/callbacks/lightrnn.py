"""Table learning for Hybrid-LightRNN: alternate LM training and word reallocation
(LightRNN, Li et al. 2016, §3.3; seed 002 §3, Eq. 6).

Every ``every_n_epochs`` epochs the head accumulates, during the training forward passes of
that epoch, each table word's code negative log-likelihoods for every row and every column
(``HybridLightRNN.collect_costs``); at the end of the epoch the callback sums them over ranks,
rank 0 solves the minimum-cost matching of words to cells (``propose_cells``) and every rank
installs the new table (``install_cells``). A plain loop calls ``HybridLightRNN.reallocate``.
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from heads.lightrnn.allocation import TableLearning, assignment_cost
from heads.validation import check_choice, check_positive_int
from tasks.callbacks.common import head_with


class LightRNNReallocation(Callback):
    """Alternate training and table reallocation for a head that learns its word table
    (:class:`heads.lightrnn.allocation.TableLearning`, e.g. :class:`heads.HybridLightRNN`).

    In every epoch ``e >= start_epoch`` with ``(e + 1) % every_n_epochs == 0``, except the
    last one of ``max_epochs``, the head
    accumulates Eq. 6 costs during its training forward passes; at the end of that epoch
    the costs are summed over DDP ranks, rank 0 solves the matching and broadcasts the new
    table, and the head installs it. Each reallocation logs ``lightrnn/table_change`` (fraction
    of table words that moved), ``lightrnn/rows_changed`` (fraction that changed row),
    ``lightrnn/cost_before`` and ``lightrnn/cost_after`` (the table words' mean code NLL per
    token under the old and new table, from the accumulated costs: the loss being optimised).

    Args:
        every_n_epochs: train this many epochs between reallocations.
        start_epoch: first epoch whose costs may trigger a reallocation.
        solver: ``"exact"`` (``linear_sum_assignment``), ``"approximate"`` (block coordinate
            descent) or ``"auto"`` (exact up to ``exact_max_words`` table words).
        exact_max_words: size limit of ``"auto"``'s exact solver.
        max_sweeps: sweeps of the approximate solver.
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        start_epoch: int = 0,
        solver: Literal["auto", "exact", "approximate"] = "auto",
        exact_max_words: int = 2000,
        max_sweeps: int = 10,
    ) -> None:
        owner, where = "LightRNNReallocation", "the callback's init_args"
        for key, value, low in (("every_n_epochs", every_n_epochs, 1), ("start_epoch", start_epoch, 0),
                                ("exact_max_words", exact_max_words, 0), ("max_sweeps", max_sweeps, 1)):
            check_positive_int(value, key, owner, minimum=low, where=where)
        check_choice(solver, "solver", owner, ("auto", "exact", "approximate"), where=where)
        self.every_n_epochs, self.start_epoch, self.solver = every_n_epochs, start_epoch, solver
        self.exact_max_words, self.max_sweeps = exact_max_words, max_sweeps
        self.history: list[dict[str, float]] = []

    @staticmethod
    def head_of(pl_module: pl.LightningModule) -> TableLearning:
        return head_with(pl_module, TableLearning, "LightRNNReallocation", "a model whose head learns a word table (e.g. HybridLightRNN)",
                         "use configs/heads/hybrid_lightrnn*.yaml or drop the callback")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.head_of(pl_module)

    def _due(self, epoch: int, max_epochs: int | None = None) -> bool:
        # No reallocation after the final epoch: no training would follow to adapt the weights
        # to the new table, and the model left in memory would not match its last checkpoint.
        final = max_epochs is not None and max_epochs >= 0 and epoch >= max_epochs - 1
        return epoch >= self.start_epoch and (epoch + 1) % self.every_n_epochs == 0 and not final

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = self.head_of(pl_module)
        head.take_costs()  # drop costs of an epoch that was cut short
        if self._due(trainer.current_epoch, trainer.max_epochs):
            head.collect_costs()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = self.head_of(pl_module)
        costs = head.take_costs()
        if costs is None:
            return
        row_cost = trainer.strategy.reduce(costs.row_cost, reduce_op="sum")  # (n, d1) summed over ranks
        col_cost = trainer.strategy.reduce(costs.col_cost, reduce_op="sum")  # (n, d2)
        tokens = float(trainer.strategy.reduce(costs.tokens, reduce_op="sum").sum())
        R, Cc = row_cost.cpu().numpy(), col_cost.cpu().numpy()
        current = head.table_cells()
        proposal = None
        if trainer.is_global_zero:
            proposal = head.propose_cells(R, Cc, self.solver, self.exact_max_words, self.max_sweeps)
        proposal = trainer.strategy.broadcast(proposal, src=0)
        record = {
            "epoch": float(trainer.current_epoch),
            **head.install_cells(proposal),
            "cost_before": assignment_cost(R, Cc, current) / max(tokens, 1.0),
            "cost_after": assignment_cost(R, Cc, proposal) / max(tokens, 1.0),
        }
        self.history.append(record)
        for key in ("table_change", "rows_changed", "cost_before", "cost_after"):
            pl_module.log(f"lightrnn/{key}", record[key], on_step=False, on_epoch=True)
