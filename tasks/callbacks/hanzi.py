"""Callbacks for character recognition: misclassified validation images in TensorBoard and
``predict`` results written to CSV. They work with any classification task whose module maps
``batch["input"]`` to a hidden state and owns a ``head``, and any datamodule (its ``class_names``)."""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from datamodules.base import as_head_datamodule
from datamodules.files import check_output_file, write_atomically
from datamodules.hanzi import HanziDataModule
from tasks.base import IGNORE_INDEX


def _classes(trainer: pl.Trainer) -> list[str]:
    datamodule = as_head_datamodule(trainer.datamodule)
    if datamodule is None:
        raise ValueError("the hanzi callbacks need the trainer's datamodule for its class names (id -> character)")
    return datamodule.class_names


def check_classification_task(owner: str, pl_module: pl.LightningModule) -> None:
    """Refuse, in one line before the run starts, a task these callbacks cannot read: they call the
    module on ``batch["input"]`` and read class ids from its head, which a classification task does
    (a language model has no such forward, and failed after its first training step)."""
    from tasks.classification import ClassificationTask

    if not isinstance(pl_module, ClassificationTask):
        raise ValueError(
            f"{owner} needs a classification task (tasks.ClassificationTask), got {type(pl_module).__name__}: "
            f"configs/hanzi/*.yaml are for the character task; for a language model use configs/heads/dsN.yaml "
            f"(e.g. configs/heads/ds8.yaml), or remove {owner} from trainer.callbacks"
        )


class MisclassifiedImages(pl.Callback):
    """Logs up to ``max_images`` misclassified validation images per epoch as one grid.

    Each tile is the input (ink dark) above a strip reading ``true>predicted`` drawn with a
    CJK font (the first found; plain ids if none), so the grid is readable on its own. The same
    pairs are logged as text. Only the first batches are re-scored, until enough errors are
    collected, so the cost is a few extra forward passes per epoch.
    """

    def __init__(self, max_images: int = 32, tag: str = "val/misclassified") -> None:
        if max_images < 1:
            raise ValueError(f"MisclassifiedImages needs max_images >= 1, got {max_images} (set init_args.max_images)")
        self.max_images = max_images
        self.tag = tag
        self._examples: list[tuple[np.ndarray, int, int]] = []
        self._font: ImageFont.FreeTypeFont | None | bool = False  # False = not searched yet

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_classification_task("MisclassifiedImages", pl_module)

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._examples = []

    @torch.no_grad()
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if trainer.sanity_checking or len(self._examples) >= self.max_images:
            return
        predicted = pl_module.head.topk(pl_module(batch["input"]), 1)[1][:, 0]  # (B,)
        target = batch["target"]
        wrong = torch.nonzero((predicted != target) & (target != IGNORE_INDEX)).flatten()  # padding items (DDP shards) are not mistakes
        for i in wrong[: self.max_images - len(self._examples)].tolist():
            image = batch["input"][i, 0].float().cpu().numpy()  # (H, W), ink = 1
            self._examples.append((image, int(batch["target"][i]), int(predicted[i])))

    def _label_font(self, height: int) -> ImageFont.FreeTypeFont | None:
        if self._font is False:
            from datamodules.fonts import find_cjk_fonts

            try:
                face = find_cjk_fonts(characters="永")[0]
                self._font = ImageFont.truetype(face.path, height, index=face.index)
            except ValueError:
                self._font = None
        return self._font  # type: ignore[return-value]

    def tile(self, image: np.ndarray, label: str) -> np.ndarray:
        """``(H, W)`` ink-1 image -> ``(H + strip, W)`` uint8 tile with the label below."""
        height, width = image.shape
        strip = max(12, height // 3)
        canvas = Image.new("L", (width, height + strip), 255)
        canvas.paste(Image.fromarray(np.uint8(255 - 255 * np.clip(image, 0, 1))), (0, 0))
        ImageDraw.Draw(canvas).text((width / 2, height + strip / 2), label, fill=0, anchor="mm", font=self._label_font(strip - 2))
        return np.asarray(canvas)

    def grid(self, classes: list[str]) -> np.ndarray | None:
        """All collected examples as one ``(rows * tile_h, cols * tile_w)`` uint8 image."""
        if not self._examples:
            return None
        font = self._label_font(12)
        name = (lambda i: classes[i]) if font is not None else str
        tiles = [self.tile(img, f"{name(t)}>{name(p)}") for img, t, p in self._examples]
        cols = min(8, len(tiles))
        rows = math.ceil(len(tiles) / cols)
        tiles += [np.full_like(tiles[0], 255)] * (rows * cols - len(tiles))
        return np.concatenate([np.concatenate(tiles[r * cols : (r + 1) * cols], axis=1) for r in range(rows)], axis=0)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        classes = _classes(trainer)
        grid = self.grid(classes)
        experiment = getattr(trainer.logger, "experiment", None) if trainer.logger is not None else None
        if grid is None or experiment is None or not hasattr(experiment, "add_image"):
            return
        experiment.add_image(self.tag, grid, trainer.global_step, dataformats="HW")
        lines = [f"{classes[t]} (id {t}) -> {classes[p]} (id {p})" for _, t, p in self._examples]
        experiment.add_text(self.tag, "  \n".join(lines), trainer.global_step)


class PredictionWriter(pl.Callback):
    """Writes ``predict`` results to CSV: ``file, char_1..char_k, score_1..score_k, note``.

    Scores are probabilities (exp of the head's log-probabilities) from the task's
    ``predict_step`` output (``{"classes": (B, k), "log_probs": (B, k)}``); files that the
    datamodule skipped as non-images (``skip_non_images=true``) get a row with empty
    predictions and ``note = "not an image"``, so nothing is silently dropped.
    """

    #: Read by :class:`tasks.classification.ClassificationTask`, which writes its own CSV otherwise.
    writes_predictions = True

    def __init__(self, output_path: str | None = None) -> None:
        """``output_path`` defaults to ``predictions.csv`` in the run's log directory."""
        if output_path is not None:  # refused before the model predicts anything
            check_output_file(os.path.expanduser(output_path), "PredictionWriter output_path",
                              "init_args.output_path of tasks.callbacks.PredictionWriter (trainer.callbacks)")
        self.output_path = output_path
        self._rows: list[list[Any]] = []
        self._k = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_classification_task("PredictionWriter", pl_module)

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rows, self._k = [], 0

    def on_predict_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not isinstance(outputs, dict) or "classes" not in outputs or "path" not in batch:
            raise ValueError(
                "PredictionWriter needs predict_step to return {'classes', 'log_probs'} and batches with 'path' "
                "(use tasks.classification.ClassificationTask with a hanzi datamodule's predict_dir)"
            )
        classes = _classes(trainer)
        ids = outputs["classes"].cpu().tolist()
        probs = outputs["log_probs"].float().exp().cpu().tolist()
        self._k = max(self._k, len(ids[0]) if ids else 0)
        for path, row_ids, row_probs in zip(batch["path"], ids, probs):
            self._rows.append([path, [classes[i] for i in row_ids], [f"{p:.6f}" for p in row_probs], ""])

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        skipped = trainer.datamodule.skipped_files if isinstance(trainer.datamodule, HanziDataModule) else []
        if self.output_path is None:
            path = Path(trainer.log_dir or trainer.default_root_dir) / "predictions.csv"
        else:
            path = Path(self.output_path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        k = self._k
        header = ["file", *[f"char_{i + 1}" for i in range(k)], *[f"score_{i + 1}" for i in range(k)], "note"]
        buffer = io.StringIO(newline="")
        writer = csv.writer(buffer)
        writer.writerow(header)
        for file, chars, scores, note in self._rows:
            writer.writerow([file, *chars, *scores, note])
        for file in skipped:
            writer.writerow([file, *[""] * (2 * k), "not an image"])
        write_atomically(str(path), buffer.getvalue())  # never a truncated CSV
