"""Sparsity, utilisation and cost of DS-Softmax experts per epoch, to the loggers."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from datamodules.base import ClassHierarchy, HeadDataModule
from heads.ds.interface import SparseExperts, speedup
from tasks.callbacks.common import DS_GROUP, EpochAccumulator, log_metrics, reduce_sum, sparse_experts

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Columns of the expert x class heatmap: beyond it, consecutive classes (in the plotted order)
#: share a column, coloured by the share of them an expert keeps (V = 10,000: 20 per column).
MAX_HEATMAP_COLUMNS = 500


class SparsityTracker(EpochAccumulator):
    """Per-epoch sparsity, utilisation and cost of the sparse experts, to the loggers.

    Scalars: mean kept fraction, theoretical speed-up ``1 / Σ_k u_k f_k`` (``u_k`` share of
    the epoch's training contexts routed to expert k, ``f_k`` its kept fraction of the vocabulary), FLOPs reduction
    ``V / (K + Σ_k u_k n_k)`` (full softmax: ``V·d`` multiply-adds per context; DS: gate ``K·d``
    plus the chosen expert's ``n_k·d``), head memory. TensorBoard also gets histograms of
    per-expert sparsity, utilisation and redundancy (experts keeping each class) and an
    expert x class heatmap (:func:`expert_class_figure`: classes grouped by the datamodule's
    ``super_class_of`` when it has one, else by the first expert keeping them), all at the
    global step, as the scalars; every tag is ``~ds/sparsity/*``
    (:data:`tasks.callbacks.common.DS_GROUP`). At the end of training the class lists
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
                f"{DS_GROUP}/sparsity/num_experts": float(K),
                f"{DS_GROUP}/sparsity/kept_fraction": float(rows.sum() / (K * V)),
                f"{DS_GROUP}/sparsity/theoretical_speedup": speedup(utilisation, kept_fraction),
                f"{DS_GROUP}/sparsity/flops_reduction": V / (K + float((utilisation * rows).sum())),
                f"{DS_GROUP}/sparsity/mean_redundancy": float(mask.sum(0).float().mean()),
                f"{DS_GROUP}/sparsity/head_memory_mib": head.memory_bytes() / 2**20,
            },
            "per_expert_sparsity": 1.0 - kept_fraction,
            "utilisation": utilisation,
            "redundancy": mask.sum(0),
            "mask": mask,
        }

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = sparse_experts(pl_module, "SparsityTracker")
        own = self._load if self._load is not None else torch.zeros(head.num_experts)
        summary = self.summarize(head, reduce_sum(trainer, own))
        self.last = summary["scalars"]
        log_metrics(trainer, self.last)
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if not isinstance(logger, TensorBoardLogger):
                continue
            writer, step = logger.experiment, trainer.global_step
            writer.add_histogram(f"{DS_GROUP}/sparsity/per_expert_sparsity", summary["per_expert_sparsity"], step)
            writer.add_histogram(f"{DS_GROUP}/sparsity/utilisation", summary["utilisation"], step)
            writer.add_histogram(f"{DS_GROUP}/sparsity/redundancy", summary["redundancy"].float(), step)
            if self.heatmap:
                datamodule = getattr(trainer, "datamodule", None)
                super_class_of = datamodule.super_class_of if isinstance(datamodule, ClassHierarchy) else None
                writer.add_figure(f"{DS_GROUP}/sparsity/expert_class_heatmap", expert_class_figure(summary["mask"], super_class_of), step)

    @staticmethod
    def class_order(num_classes: int, trainer: pl.Trainer | None) -> Tensor:
        """Classes grouped by ground-truth super-class when the data knows it, else by id."""
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        if not isinstance(datamodule, ClassHierarchy):
            return torch.arange(num_classes)
        return torch.argsort(torch.as_tensor(datamodule.super_class_of), stable=True)

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


def class_groups(mask: Tensor, super_class_of: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
    """The heatmap's class order and each class's group in that order, both ``(V,)``: classes
    grouped by super-class when the data knows it (the paper's synthetic hierarchy, App. A), else
    by the first expert keeping them (classes no expert keeps last); by class id within a group."""
    K, V = mask.shape
    if super_class_of is not None:
        group = torch.as_tensor(super_class_of)
    else:
        kept = mask.bool()
        group = torch.where(kept.any(0), kept.int().argmax(0), torch.full((V,), K))  # argmax: first True
    order = torch.argsort(group, stable=True)
    return order, group[order]


def expert_class_figure(mask: Tensor, super_class_of: Sequence[int] | None = None,
                        max_columns: int = MAX_HEATMAP_COLUMNS) -> Figure:
    """The expert x class kept mask as a labelled figure: experts down, classes across in
    :func:`class_groups` order with a line between groups (when at most 64, so the blocks of a
    specialised model show), a colour bar. Above ``max_columns`` classes, consecutive classes share
    a column coloured by the share of them the expert keeps.

    Shape: mask ``(K, V)``, K experts by V classes.
    """
    from matplotlib.figure import Figure  # imported on use: the callbacks load without it
    from matplotlib.ticker import MaxNLocator

    K, V = mask.shape
    order, groups = class_groups(mask, super_class_of)
    per_column = math.ceil(V / max_columns)
    columns = math.ceil(V / per_column)
    kept = torch.zeros(K, columns * per_column)
    kept[:, :V] = mask[:, order].float()
    sizes = torch.full((columns,), float(per_column))
    sizes[-1] = V - (columns - 1) * per_column  # the last column holds the remainder
    share = kept.view(K, columns, per_column).sum(-1) / sizes  # (K, columns)

    figure = Figure(figsize=(10, min(8.0, 2.0 + 0.12 * K)), dpi=100, layout="constrained")
    ax = figure.add_subplot()
    # extent in class positions, so group lines and the x axis count classes, not columns
    image = ax.imshow(share.numpy(), aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0, vmax=1.0,
                      extent=(0, V, K - 0.5, -0.5))
    boundaries = (torch.nonzero(groups[1:] != groups[:-1]).squeeze(1) + 1).tolist()
    if len(boundaries) < 64:
        for x in boundaries:
            ax.axvline(x, color="white", linewidth=0.6)
    grouping = "super-class" if super_class_of is not None else "first expert keeping them"
    binned = f", {per_column} per column" if per_column > 1 else ""
    ax.set_xlabel(f"classes ({V}, grouped by {grouping}{binned})")
    ax.set_ylabel(f"experts ({K})")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("classes each expert keeps")
    figure.colorbar(image, ax=ax, label="share of the column's classes kept" if per_column > 1 else "kept")
    return figure


def class_names(datamodule: Any, num_classes: int) -> list[str]:
    """The datamodule's class names (the data contract, :class:`datamodules.base.HeadDataModule`),
    or the class ids when there is none or it names another number of classes."""
    names = datamodule.class_names if isinstance(datamodule, HeadDataModule) else None
    if names is None or len(names) != num_classes:
        return [str(c) for c in range(num_classes)]
    return [str(n) for n in names]
