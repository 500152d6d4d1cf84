"""Terminal output of a run: a line-per-update progress report when stdout is not a terminal, and
the summary a ``fit`` ends with.

Lightning's bars redraw one line with carriage returns; written to a file (a job scheduler's log,
``| tee``) that is megabytes of frames. :class:`LineProgressBar` prints a complete line instead,
at most every ``interval`` seconds (10 by default) and at the end of every epoch, validation, test
and predict loop::

    Epoch 0: 27/536 (5%) 12.3 it/s train/loss=2.77
    Validation (epoch 0, step 536): val/loss=2.79 val/ppl=16.4
    Epoch 0: 536/536 (100%) 14.1 it/s train/loss=2.41 val/ppl=16.4
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar


class LineProgressBar(ProgressBar):
    """A progress bar that prints whole lines (for logs): every ``interval`` seconds while a loop
    runs and once when it ends, with the metrics the task shows in the progress bar.

    Args:
        interval: seconds between two lines of one loop (the first batch and the end of each loop
            always print).
    """

    def __init__(self, interval: float = 10.0) -> None:
        super().__init__()
        self.interval = interval
        self._enabled = True
        self._last = -math.inf
        self._started = 0.0
        self._done = 0
        self._offset: int | None = None  # batches done before this process's first one (a resume)

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    # ---------------------------------------------------------------- helpers
    def _start(self) -> None:
        self._started, self._last, self._done, self._offset = time.monotonic(), -math.inf, 0, None

    def _line(self, description: str, done: int, total: float, pl_module: pl.LightningModule, final: bool) -> None:
        self._done = done
        now = time.monotonic()
        if self._offset is None:  # this process's first batch of the loop (after a resume: not the epoch's)
            self._offset = done - 1
        if not self._enabled or (not final and now - self._last < self.interval and done != 1):
            return
        self._last = now
        known = isinstance(total, int) or (isinstance(total, float) and math.isfinite(total))
        count = f"{done}/{int(total)} ({100 * done / max(total, 1):.0f}%)" if known and total else f"{done}/?"
        rate = (done - self._offset) / max(now - self._started, 1e-9)
        metrics = " ".join(f"{name}={format_value(value)}" for name, value in self.get_metrics(self.trainer, pl_module).items()
                           if name != "v_num")
        print(f"{description}: {count} {rate:.1f} it/s {metrics}".rstrip(), flush=True)

    # ---------------------------------------------------------------- training
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start()  # a run resumed mid-epoch continues its epoch without on_train_epoch_start

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # batch_idx counts from the epoch's start, also after a mid-epoch resume
        self._line(f"Epoch {trainer.current_epoch}", batch_idx + 1, self.total_train_batches, pl_module, final=False)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._line(f"Epoch {trainer.current_epoch}", self._done, self.total_train_batches, pl_module, final=True)

    # ---------------------------------------------------------------- evaluation
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and self._enabled:
            # the checkpoint's monitored value first (val/loss unless configured), then the task's own
            monitor = getattr(trainer.checkpoint_callback, "monitor", None)
            metrics = {monitor: trainer.callback_metrics[monitor]} if monitor in trainer.callback_metrics else {}
            metrics.update((k, v) for k, v in self.get_metrics(trainer, pl_module).items() if k.startswith("val"))
            shown = " ".join(f"{name}={format_value(value)}" for name, value in metrics.items())
            where = f" (epoch {trainer.current_epoch}, step {trainer.global_step})" if trainer.training or trainer.state.fn == "fit" else ""
            print(f"Validation{where}: {shown}".rstrip(), flush=True)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start()

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        total = sum(trainer.num_test_batches)
        self._line("Testing", self._done + 1, total, pl_module, final=self._done + 1 == total)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start()

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        total = sum(trainer.num_predict_batches)
        self._line("Predicting", self._done + 1, total, pl_module, final=self._done + 1 == total)


def format_value(value: Any) -> str:
    """A progress-bar metric as text: floats with four significant digits."""
    if hasattr(value, "item"):
        value = value.item()
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def fit_summary(trainer: pl.Trainer) -> list[str]:
    """The lines a ``fit`` ends with: the best checkpoint and its monitored value, the last
    checkpoint, and where the logs are. Called on rank 0 only: it joins no collective."""
    lines = []
    callback = trainer.checkpoint_callback
    if callback is not None:
        best, score = getattr(callback, "best_model_path", ""), getattr(callback, "best_model_score", None)
        monitor = getattr(callback, "monitor", None)
        if best:
            value = f" ({monitor} {float(score):.4g})" if monitor and score is not None else ""
            lines.append(f"best checkpoint: {best}{value}")
        if getattr(callback, "last_model_path", ""):
            lines.append(f"last checkpoint: {callback.last_model_path}")
    # the logger's own log_dir: Trainer.log_dir is a broadcast that every DDP rank would have to join
    log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
    if log_dir:
        root = Path(log_dir)
        lines.append(f"logs: {root} (tensorboard --logdir {root.parent.parent if root.name.startswith('version_') else root})")
    return lines


def choose_progress_bar(terminal: bool | None = None) -> type[ProgressBar] | None:
    """``None`` (keep Lightning's redrawing bar) on a terminal, :class:`LineProgressBar` otherwise."""
    terminal = sys.stdout.isatty() if terminal is None else terminal
    return None if terminal else LineProgressBar
