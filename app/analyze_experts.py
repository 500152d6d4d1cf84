"""``python -m app analyze experts``: purity, redundancy, utilisation and heatmap of a DS-Softmax model.

Purity (how well the experts rediscover a known class hierarchy): route every test sample,
count for each class ``c`` how often each expert is chosen, and call the argmax its
*most-used expert*. A super-class's *majority expert* is the most common most-used expert
among its sub-classes; the super-class's purity is the fraction of its sub-classes whose
most-used expert is that majority expert. Reported purity is the mean over super-classes
(1.0: every super-class is served by a single expert). We also report *expert purity*, the
textbook cluster purity seen from the experts: the share of routed samples whose
super-class is the majority super-class of the expert they were routed to.

Works from a checkpoint alone (model and datamodule are rebuilt from it) or from objects
(:func:`expert_statistics`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from typing import Any

import torch
from torch import Tensor

from heads.ds_callbacks import SparsityTracker, class_names
from heads.ds_softmax import SparseExperts, speedup


@torch.no_grad()
def routing_by_class(model: torch.nn.Module, loader: Any, num_experts: int, num_classes: int) -> Tensor:
    """``(K, V)`` counts of samples of class ``c`` routed to expert ``k``."""
    counts = torch.zeros(num_experts, num_classes, dtype=torch.long)
    model.eval()
    for batch in loader:
        hidden = model(batch["input"].to(model.device))
        target = batch["target"].reshape(-1).cpu()
        expert, _ = model.head.route(hidden.reshape(-1, hidden.shape[-1]))
        valid = target >= 0
        counts.index_put_((expert.cpu()[valid], target[valid]), torch.ones(int(valid.sum()), dtype=torch.long), accumulate=True)
    return counts


def purity(routing: Tensor, super_class_of: list[int]) -> tuple[float, float]:
    """(super-class purity, expert purity) from ``(K, V)`` routing counts (see module docstring)."""
    supers = torch.as_tensor(super_class_of)
    most_used = routing.argmax(0)  # (V,) most-used expert of each class
    seen = routing.sum(0) > 0
    scores = []
    for s in supers.unique().tolist():
        members = (supers == s) & seen
        if members.any():
            experts = most_used[members]
            majority = torch.bincount(experts).argmax()
            scores.append(float((experts == majority).float().mean()))
    num_super = int(supers.max()) + 1
    by_super = torch.zeros(routing.shape[0], num_super, dtype=torch.long).index_add_(1, supers, routing)  # (K, S)
    expert_purity = float(by_super.max(1).values.sum()) / max(1, int(routing.sum()))
    return sum(scores) / max(1, len(scores)), expert_purity


def expert_statistics(model: torch.nn.Module, loader: Any, super_class_of: list[int] | None = None) -> dict[str, Any]:
    """Purity, utilisation, redundancy, kept fractions and theoretical speed-up of ``model.head``."""
    head = model.head
    if not isinstance(head, SparseExperts):
        raise ValueError(f"analyze experts needs a model whose head exposes the sparse-experts interface (e.g. DSSoftmax), got {type(head).__name__}")
    routing = routing_by_class(model, loader, head.num_experts, head.num_classes)
    load = routing.sum(1).float()
    utilisation = load / load.sum().clamp_min(1)
    kept = head.rows_per_expert().float().cpu()
    mask = head.kept_mask().cpu()
    stats: dict[str, Any] = {
        "num_experts": head.num_experts,
        "num_classes": head.num_classes,
        "utilisation": [round(float(u), 4) for u in utilisation],
        "classes_per_expert": [int(n) for n in kept],
        "kept_fraction": float(kept.sum() / (head.num_experts * head.num_classes)),
        "redundancy_histogram": torch.bincount(mask.sum(0), minlength=head.num_experts + 1).tolist(),
        "theoretical_speedup": speedup(utilisation, kept / head.num_classes),
        "flops_reduction": head.num_classes / (head.num_experts + float((utilisation * kept).sum())),
        "routing": routing,
        "mask": mask,
    }
    if super_class_of is not None:
        stats["purity"], stats["expert_purity"] = purity(routing, super_class_of)
    return stats


def save_heatmap(mask: Tensor, order: Tensor, path: str) -> None:
    """Expert x class kept-mask image, classes in ``order``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, max(2.0, mask.shape[0] * 0.15)))
    ax.imshow(mask[:, order].float().numpy(), aspect="auto", interpolation="nearest", cmap="Greys")
    ax.set_xlabel("class (grouped by super-class)")
    ax.set_ylabel("expert")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_from_checkpoint(path: str) -> tuple[Any, Any]:
    """Rebuild model and datamodule from a checkpoint (class paths and hyper-parameters inside)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    data_path = checkpoint.get("datamodule_class_path")
    if data_path is None:
        raise ValueError(f"checkpoint {path} has no datamodule_class_path: write it with a HeadTask run (python -m app fit)")
    module_name, _, name = data_path.rpartition(".")
    data_cls = getattr(importlib.import_module(module_name), name)
    hparams = {k: v for k, v in checkpoint.get("datamodule_hyper_parameters", {}).items() if not k.startswith("_")}
    datamodule = data_cls(**hparams)
    model_path = checkpoint.get("hyper_parameters", {}).get("_class_path", "tasks.classification.ClassificationTask")
    module_name, _, name = model_path.rpartition(".")
    model = getattr(importlib.import_module(module_name), name).load_from_checkpoint(path, map_location="cpu")
    return model, datamodule


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app analyze experts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="checkpoint of a ClassificationTask with a DS-Softmax head")
    parser.add_argument("--split", choices=("train", "val", "test"), default="test")
    parser.add_argument("--output_dir", default=None, help="where to write experts.json and heatmap.png (default: beside the checkpoint)")
    parser.add_argument("--num_smallest", type=int, default=3, help="class lists of this many smallest experts (App. C)")
    args = parser.parse_args(argv)
    model, datamodule = load_from_checkpoint(args.ckpt_path)
    datamodule.setup("test")
    loader = getattr(datamodule, f"{'val' if args.split == 'val' else args.split}_dataloader")()
    super_class_of = getattr(datamodule, "super_class_of", None)
    stats = expert_statistics(model, loader, super_class_of)
    out_dir = args.output_dir or os.path.dirname(os.path.abspath(args.ckpt_path))
    os.makedirs(out_dir, exist_ok=True)
    order = SparsityTracker.class_order(model.head.num_classes, None) if super_class_of is None else torch.argsort(torch.as_tensor(super_class_of), stable=True)
    save_heatmap(stats["mask"], order, os.path.join(out_dir, "heatmap.png"))
    names = class_names(datamodule, model.head.num_classes)
    smallest = torch.argsort(stats["mask"].sum(1), stable=True)[: args.num_smallest].tolist()
    stats["smallest_experts"] = {int(k): [names[c] for c in stats["mask"][k].nonzero().squeeze(1).tolist()[:50]] for k in smallest}
    report = {k: v for k, v in stats.items() if k not in ("routing", "mask")}
    with open(os.path.join(out_dir, "experts.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    for key in ("num_experts", "purity", "expert_purity", "kept_fraction", "theoretical_speedup", "flops_reduction"):
        if key in report:
            value = report[key]
            print(f"{key:>20}: {value:.4f}" if isinstance(value, float) else f"{key:>20}: {value}")
    print(f"{'redundancy':>20}: {report['redundancy_histogram']}")
    print(f"{'utilisation':>20}: {report['utilisation']}")
    for k, classes in report["smallest_experts"].items():
        print(f"expert {k}: {' '.join(classes)}")
    print(f"wrote {os.path.join(out_dir, 'experts.json')} and heatmap.png")
    return 0
