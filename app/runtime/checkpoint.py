"""The checkpoint callback of every run (``--checkpoint.*``)."""

from __future__ import annotations

import os
import warnings
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from app.runtime.locks import LOCK_NAME


class TopKAndLastCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``last.ckpt`` follows every scheduled save.

    Lightning 2.6 rewrites ``last.ckpt`` only at a step where it also wrote a top-k checkpoint,
    so once ``val/loss`` stops improving ``last.ckpt`` goes stale and a resumed run would
    silently restart from the best epoch instead of the latest one. Here ``last.ckpt`` is
    refreshed on the same schedule as the top-k check (every ``every_n_epochs`` validation),
    whether or not the score improved."""

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    #: Set by the CLI when the run resumes from a checkpoint of its own directory.
    resuming_here = False
    #: Set by the CLI for ``validate|test|predict``: nothing is saved, and the top-k bookkeeping
    #: a checkpoint carries (the training run's) is not restored.
    evaluating = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # A non-empty directory is no surprise when it holds only the run's own lock file
        # (app/runtime/locks.py) or when the run continues its own checkpoints: no warning then.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            super().setup(trainer, pl_module, stage)
        for warning in caught:
            expected = "exists and is not empty" in str(warning.message) and (
                self.resuming_here or {p.name for p in Path(self.dirpath).iterdir()} <= {LOCK_NAME})
            if not expected:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's restore of the top-k bookkeeping, keeping only paths of checkpoint files
        directly inside this callback's directory (``.ckpt`` files that torch.save wrote, or gone).
        The paths come from the checkpoint file, and Lightning later deletes the ones that fall
        out of the top k: a path written as ``<dirpath>/../../file`` passes its ``dirpath in
        parents`` test, and a user's own ``notes.ckpt`` beside the run's would be removed. A
        checkpoint never chooses a path (:mod:`app.checkpoint_io.policy`). An evaluation
        (:attr:`evaluating`) restores none of it."""
        if self.evaluating:
            return
        super().load_state_dict(state_dict)
        own = os.path.realpath(self.dirpath) if self.dirpath else None

        def inside(path: Any) -> bool:
            return (own is not None and isinstance(path, str) and path.endswith(".ckpt")
                    and os.path.dirname(os.path.realpath(path)) == own
                    and (not os.path.lexists(path) or written_by_torch_save(path)))

        self.best_k_models = {path: score for path, score in self.best_k_models.items() if inside(path)}
        for name in ("kth_best_model_path", "best_model_path", "last_model_path"):
            if getattr(self, name) and not inside(getattr(self, name)):
                setattr(self, name, "")
        if self.kth_best_model_path == "" and self.best_k_models:
            worst = max if self.mode == "min" else min
            self.kth_best_model_path = worst(self.best_k_models, key=self.best_k_models.get)
            self.kth_value = self.best_k_models[self.kth_best_model_path]

    def _refresh_last(self, trainer: pl.Trainer) -> None:
        scheduled = self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0
        # Skipped when this step already saved (a top-k save also wrote last.ckpt).
        if self.save_last and scheduled and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def written_by_torch_save(path: str) -> bool:
    """Whether ``path`` is a regular file holding the zip archive torch.save writes (its pickle
    record ``<name>/data.pkl``)."""
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return False
