"""Generation and its evaluation, shared by the tasks that produce text (translation, captioning).

A :class:`GenerationTask` trains its network under teacher forcing (token NLL from the head) and
evaluates a split in two parts:

* **token NLL** of every target token, summed in a :class:`tasks.metrics.TokenMetrics` (its sums
  are reduced across DDP ranks by torchmetrics and divided once): ``{stage}/loss``,
  ``{stage}/ppl`` and ``{stage}/tokens`` count each target token of the split exactly once;
* **generated outputs** (:class:`Generated`) of the first samples of the split, decoded with
  :mod:`tasks.decoding` by the subclass's :meth:`GenerationTask.generate`, gathered from every
  rank, put in data order and scored once by :meth:`GenerationTask.score_outputs` (BLEU/chrF,
  COCO metrics).

A subclass sets ``target_key`` (the batch's teacher-forced targets) and implements
``head_input`` (the decoder's states under teacher forcing), ``selected_rows``, ``generate`` and ``score_outputs``; ids become text through the data contract
(:meth:`tasks.base.HeadTask.decode_text`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor
from torchmetrics import Metric

from datamodules.files import write_atomically
from tasks.base import IGNORE_INDEX, HeadTask, global_mean_count
from tasks.metrics import TokenMetrics


@dataclass
class Generated:
    """One generated output: its position in the split (``index``), the text, the references it
    is scored against, and what else a task shows or writes beside it (``source``). ``key``
    identifies the sample (an image id; the line by default): gathering keeps one output per key."""

    index: int
    text: str
    references: list[str] = field(default_factory=list)
    source: str = ""
    key: int | None = None

    def __post_init__(self) -> None:
        if self.key is None:
            self.key = self.index


def compute_all_ranks(metric: Metric) -> Any:
    """``metric.compute()``, its states reduced over DDP ranks (every rank must call it). A rank
    that saw no batch of the split (or a split without batches) still joins, without a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
        return metric.compute()


def write_lines(path: str, lines: list[str]) -> None:
    """Write one output per line, atomically (newlines inside an output would break alignment)."""
    write_atomically(path, "".join(line.replace("\n", " ") + "\n" for line in lines), "output file")


class GenerationTask(HeadTask):
    """A :class:`tasks.base.HeadTask` that generates text; see the module docstring."""

    target_key: str = "target_output"

    def __init__(
        self,
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_scheduler: LRSchedulerCallable | None = None,
        monitor: str = "val/loss",
        compile: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__(optimizer=optimizer, lr_scheduler=lr_scheduler, monitor=monitor, compile=compile)
        self.eval_metrics = TokenMetrics(topk=(), ignore_index=IGNORE_INDEX)
        self.outputs: list[Generated] = []

    # ------------------------------------------------------------------ subclass hooks
    def token_nll(self, batch: dict[str, Any]) -> Tensor:
        """Per-token NLL ``(B, T)`` under teacher forcing (:meth:`head_input`), zero at padding."""
        return self.head(self.head_input(batch), batch[self.target_key])

    def training_objective(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """``(summed training loss, summed NLL)`` of a batch; the NLL unless overridden."""
        nll_sum = self.token_nll(batch).sum()
        return nll_sum, nll_sum

    def selected_rows(self, batch: dict[str, Any], limit: int) -> list[int]:
        """Rows of ``batch`` to generate for (``limit`` samples from the split's start; -1 = all)."""
        raise NotImplementedError

    def generate(self, batch: dict[str, Any], rows: list[int], beam_size: int) -> list[Generated]:
        """Decode ``rows`` of ``batch`` with ``beam_size`` (1 = greedy)."""
        raise NotImplementedError

    def score_outputs(self, stage: str, outputs: list[Generated], loss: float) -> dict[str, float]:
        """Score the gathered outputs of a split (every rank calls it), log and return the scores."""
        raise NotImplementedError

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict[str, Any] | None, batch_idx: int) -> Tensor | None:
        if batch is None:  # every sample of the batch was skipped as unreadable
            return None
        tokens = (batch[self.target_key] != IGNORE_INDEX).sum().clamp(min=1)
        objective_sum, nll_sum = self.training_objective(batch)
        # Ranks hold sentences of different lengths: dividing by the global mean token count makes
        # the DDP-averaged step the per-token mean over every rank's targets (global_mean_count).
        loss = objective_sum / global_mean_count(tokens)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=int(tokens), sync_dist=True)
        self.log("train/ppl", torch.exp(nll_sum.detach() / tokens), batch_size=int(tokens))  # this rank's targets
        self.log_head_stats("train")
        return self.add_head_regularization(loss, "train")

    # ------------------------------------------------------------------ evaluation
    def reset_evaluation(self) -> None:
        self.eval_metrics.reset()
        self.outputs = []

    def on_validation_epoch_start(self) -> None:
        self.reset_evaluation()

    def on_test_epoch_start(self) -> None:
        self.reset_evaluation()

    def on_predict_epoch_start(self) -> None:
        self.reset_evaluation()

    def evaluate_batch(self, batch: dict[str, Any] | None, beam_size: int, limit: int) -> None:
        """Sum the batch's token NLL; generate for its selected rows."""
        if batch is None or batch.get("filler"):
            return  # nothing readable, or a filler that keeps DDP ranks in step (scored by another rank)
        self.eval_metrics.update(self.token_nll(batch), batch[self.target_key])
        rows = self.selected_rows(batch, limit)
        if rows:
            self.outputs.extend(self.generate(batch, rows, beam_size))

    def gather(self, items: list[Generated]) -> list[Generated]:
        """Every rank's outputs (each rank generated a disjoint share), one per key, in data order.
        A collective under DDP: every rank must call it."""
        if self.trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            parts: list[list[Generated]] = [None] * self.trainer.world_size  # type: ignore[list-item]
            torch.distributed.all_gather_object(parts, items)
            items = [item for part in parts for item in part]
        unique = {item.key: item for item in items}
        return sorted(unique.values(), key=lambda item: item.index)

    def finish_evaluation(self, stage: str) -> dict[str, float]:
        """Log the split's token loss, perplexity and token count, then score the gathered outputs."""
        values = compute_all_ranks(self.eval_metrics)  # sums reduced over ranks, divided once
        loss = float(values["loss"])
        self.log_reduced(f"{stage}/loss", loss)
        self.log_reduced(f"{stage}/ppl", math.exp(min(loss, 50.0)))
        self.log_reduced(f"{stage}/tokens", float(values["tokens"]))  # summed over ranks: each target token once
        outputs = self.gather(self.outputs)
        if not outputs:
            return {"loss": loss}
        return {"loss": loss, **self.score_outputs(stage, outputs, loss)}

    def on_validation_epoch_end(self) -> None:
        self.finish_evaluation("val")

