"""Classification with any encoder and any output head (App. A hierarchy, Chinese characters)."""

from __future__ import annotations

import csv
import io
import itertools
from pathlib import Path
from typing import Any, Sequence

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from datamodules.files import write_atomically
from tasks.base import IGNORE_INDEX, HeadSpec, HeadTask, build_head, built_modules, global_mean_count
from tasks.metrics import TokenMetrics


class ClassificationTask(HeadTask):
    """One label per input: ``encoder(batch["input"]) -> head``.

    Metrics (loss, top-k accuracy) are sums reduced across ranks by torchmetrics and divided
    once, so under DDP every sample counts exactly once. Accuracy uses ``head.topk``, i.e. the
    head's inference path (DS-Softmax answers from the chosen expert only).

    Args:
        num_classes: number of classes (linked from ``data.num_classes`` by the CLI).
        encoder: any module mapping ``batch["input"]`` to ``(B, out_features)`` and exposing
            ``out_features`` (``tasks.encoders.MLPEncoder``, ``tasks.encoders.HanziCNN``, ...).
        head: head short name or factory (``class_path`` + ``init_args`` in configs).
        num_features: input size from the data (linked by the CLI); when given, checked
            against the encoder's ``in_features``.
        eval_topk: top-k accuracies computed in validation and test.
        predict_topk: classes returned per sample by ``predict_step``.
        compile: ``torch.compile`` the encoder and the head at setup: ``true``, or a mapping of
            torch.compile options (``{mode: max-autotune}``); a run-time choice, not saved with the
            checkpoint (docs/benchmarks.md, "torch.compile").
    """

    compiled_modules = ("encoder", "head")
    hparams_metrics = ("acc@1",)

    def __init__(
        self,
        num_classes: int,
        encoder: nn.Module,
        head: HeadSpec = "softmax",
        num_features: int | None = None,
        eval_topk: Sequence[int] = (1, 5),
        predict_topk: int = 5,
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_scheduler: LRSchedulerCallable | None = None,
        compile: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__(optimizer=optimizer, lr_scheduler=lr_scheduler, monitor="val/loss", compile=compile)
        # num_features is only a check against the encoder; kept out of hparams so it never
        # clashes with the datamodule's own num_features when loggers merge both.
        # A built encoder (from Python, or from a checkpoint's class_path + init_args by Lightning's
        # instantiator) is not saved; through the CLI the encoder is its class_path/init_args dict.
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", "num_features", *self.runtime_options,
                                          *built_modules(encoder=encoder)])
        for key in ("encoder", "head"):
            # Built objects (a module, a factory) passed from Python are not configuration: keep
            # checkpoints loadable with weights_only and pass them again to load_from_checkpoint.
            # Through the CLI they are class_path/init_args dicts and stay, so checkpoints rebuild.
            if not isinstance(self.hparams.get(key), (str, dict)):
                self.hparams.pop(key, None)
        if not isinstance(encoder, nn.Module) or not isinstance(getattr(encoder, "out_features", None), int):
            raise ValueError(
                f"ClassificationTask needs an encoder nn.Module with an integer out_features, got "
                f"{type(encoder).__name__} (set model.init_args.encoder.class_path, e.g. tasks.encoders.MLPEncoder)"
            )
        encoder_in = getattr(encoder, "in_features", None)
        if num_features is not None and encoder_in is not None and encoder_in != num_features:
            raise ValueError(
                f"ClassificationTask: the data has num_features={num_features} but the encoder takes "
                f"in_features={encoder_in} (set model.init_args.encoder.init_args.in_features: {num_features})"
            )
        ks = sorted(int(k) for k in eval_topk)
        if any(k < 1 or k > num_classes for k in ks) or not 1 <= predict_topk <= num_classes:
            raise ValueError(
                f"ClassificationTask needs eval_topk and predict_topk in 1..num_classes={num_classes}, got "
                f"{list(eval_topk)} and {predict_topk} (set model.init_args.eval_topk / predict_topk)"
            )
        self.encoder = encoder
        self.head = build_head(head, encoder.out_features, num_classes)
        self.predict_topk = predict_topk
        self.train_metrics = TokenMetrics(topk=(), ignore_index=IGNORE_INDEX)
        self.val_metrics = TokenMetrics(topk=ks, ignore_index=IGNORE_INDEX)
        self.test_metrics = TokenMetrics(topk=ks, ignore_index=IGNORE_INDEX)

    def forward(self, inputs: Tensor) -> Tensor:
        """Shape: ``batch["input"]`` -> hidden ``(B, out_features)``."""
        return self.encoder(inputs)

    def head_input(self, batch: dict[str, Tensor]) -> Tensor:
        """Shape: ``(B, out_features)``, one row per sample of ``batch["target"]``."""
        return self(batch["input"])

    # ------------------------------------------------------------------ train
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        target = batch["target"]
        nll = self.head(self(batch["input"]), target)  # (B,)
        # Divided by the global mean sample count, so the DDP-averaged step is the per-sample mean
        # over all ranks' samples, also when ranks hold different numbers (ignored targets).
        task_loss = nll.sum() / global_mean_count((target != IGNORE_INDEX).sum())
        loss = self.add_head_regularization(task_loss, "train")
        self.train_metrics.update(nll, target)
        # The task loss, as every task logs it; the regularisers are logged apart (train/reg/...).
        self.log("train/loss", task_loss.detach(), on_step=True, on_epoch=False, prog_bar=True, sync_dist=True)
        self.log_head_stats("train")
        return loss

    def on_train_epoch_end(self) -> None:
        self.log_reduced("train/epoch_loss", self.train_metrics.compute()["loss"])
        self.train_metrics.reset()

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, batch: dict[str, Tensor], metrics: TokenMetrics) -> None:
        hidden = self(batch["input"])
        nll = self.head(hidden, batch["target"])
        metrics.update(nll, batch["target"], self.head.topk(hidden, metrics.max_k)[1])

    def _log_metrics(self, stage: str, metrics: TokenMetrics) -> None:
        values = metrics.compute()
        metrics.reset()
        for name, value in values.items():
            if name == "tokens":  # summed over ranks: every sample of the split counted once
                self.log_reduced(f"{stage}/samples", value)
            elif name != "ppl":
                self.log_reduced(f"{stage}/{name}", value, prog_bar=name == "acc@1")
        self.log_hparams(stage, values)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics)

    def on_validation_epoch_end(self) -> None:
        self._log_metrics("val", self.val_metrics)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.test_metrics)

    def on_test_epoch_end(self) -> None:
        self._log_metrics("test", self.test_metrics)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Any]:
        """Top-k classes and their log-probabilities per sample, ``(B, predict_topk)`` each."""
        log_probs, classes = self.head.topk(self(batch["input"]), self.predict_topk)
        out: dict[str, Any] = {"classes": classes, "log_probs": log_probs}
        if "target" in batch:
            out["target"] = batch["target"]
        return out

    def on_predict_epoch_start(self) -> None:
        self._predicted: list[list[Any]] = []

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._has_writer() or not isinstance(outputs, dict):
            return
        targets = outputs["target"].tolist() if "target" in outputs else [None] * len(outputs["classes"])
        for classes, log_probs, target in zip(outputs["classes"].tolist(), outputs["log_probs"].float().exp().tolist(), targets):
            self._predicted.append([target, classes, probs_text(log_probs)])

    def on_predict_epoch_end(self) -> None:
        """Without a callback that writes the predictions (the character task's
        ``PredictionWriter``), write them to ``predictions.csv`` in the run's log directory:
        ``sample, target, class_1..class_k, score_1..score_k`` (class names from the data, scores
        as probabilities), every rank's rows in sample order, and print where."""
        if self._has_writer():
            return
        rows = self._predicted
        if self.trainer.world_size > 1:
            gathered: list[Any] = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(gathered, rows)
            # predict shards samples round-robin (rank r holds r, r + W, ...; the last round may be short)
            rows = [row for part in itertools.zip_longest(*gathered) for row in part if row is not None]
        if not self.trainer.is_global_zero:
            return
        names = getattr(self.trainer.datamodule, "class_names", None)
        name = (lambda i: names[i]) if names else str
        k = self.predict_topk
        lines = io.StringIO(newline="")
        writer = csv.writer(lines)
        writer.writerow(["sample", "target", *[f"class_{i + 1}" for i in range(k)], *[f"score_{i + 1}" for i in range(k)]])
        for index, (target, classes, scores) in enumerate(rows):
            writer.writerow([index, "" if target is None else name(target), *map(name, classes), *scores])
        path = Path(self.trainer.log_dir or self.trainer.default_root_dir) / "predictions.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(str(path), lines.getvalue())
        print(f"predictions: {path} ({len(rows)} samples, top {k} classes each)")

    def _has_writer(self) -> bool:
        """Whether a callback writes the predictions (``writes_predictions``, e.g. the character
        task's ``tasks.callbacks.PredictionWriter``)."""
        return any(getattr(callback, "writes_predictions", False) for callback in self.trainer.callbacks)


def probs_text(probabilities: list[float]) -> list[str]:
    """Probabilities as the CSV holds them (six decimals)."""
    return [f"{p:.6f}" for p in probabilities]
