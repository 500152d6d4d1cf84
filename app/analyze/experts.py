"""``python -m app analyze experts``: purity, redundancy, utilisation and heatmap of a DS-Softmax model.

Purity (how well the experts rediscover a known class hierarchy): route every test sample,
count for each class ``c`` how often each expert is chosen, and call the argmax its
*most-used expert*. A super-class's *majority expert* is the most common most-used expert
among its sub-classes; the super-class's purity is the fraction of its sub-classes whose
most-used expert is that majority expert. Reported purity is the mean over super-classes
(1.0: every super-class is served by a single expert). We also report *expert purity*, the
textbook cluster purity seen from the experts: the share of routed samples whose
super-class is the majority super-class of the expert they were routed to.

Head latency (``--reference_ckpt``, e.g. the full-softmax model of the same task): the hidden
states of the first ``--latency_samples`` samples of the split are computed once by each model's
own encoder; then ``head.topk(h, 1)`` is timed one sample at a time (the latency setting) and in
batches of ``--latency_batch``, the two heads interleaved repeat by repeat so they share the
machine's load; medians. The FLOPs reduction is printed beside the measured speed-up.

*Coverage* is the share of samples routed to an expert that keeps their class: the top-1
accuracy any model with this routing and these masks can reach (a sample routed elsewhere has
its class outside the candidates).

``--reference_head softmax`` instead times a freshly built head of that name and of the DS head's
shape on the DS model's hidden states: a dense head's top-1 does the same work whatever its
weights, so this measures latency (not accuracy) when no reference model was trained.

Works from a checkpoint alone (model and datamodule are rebuilt from it) or from objects
(:func:`expert_statistics`).
"""

from __future__ import annotations

import argparse
import io
import json
import os
from typing import Any

import torch
from torch import Tensor

from app.runtime.directories import check_writable_directory
from app.checkpoint_io import restore
from app.tools.common import (
    DEFAULT_TASK, add_config_argument, batch_hidden, interleaved_times, summarize, write_output,
)
from datamodules.base import ClassHierarchy
from heads.ds.interface import SparseExperts, speedup
from tasks.callbacks.sparsity import SparsityTracker
from heads.registry import available_heads, create_head


@torch.no_grad()
def routing_by_class(model: torch.nn.Module, loader: Any, num_experts: int, num_classes: int) -> Tensor:
    """``(K, V)`` counts of samples of class ``c`` routed to expert ``k``."""
    counts = torch.zeros(num_experts, num_classes, dtype=torch.long)
    model.eval()
    for batch in loader:
        hidden = batch_hidden(model, batch)
        target = batch[model.target_key].reshape(-1).cpu()
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
        # share of samples routed to an expert that keeps their class: top-1 can be right only then
        "coverage": float((routing * mask).sum()) / max(1, int(routing.sum())),
        "routing": routing,
        "mask": mask,
    }
    if super_class_of is not None:
        stats["purity"], stats["expert_purity"] = purity(routing, super_class_of)
    return stats


@torch.no_grad()
def hidden_states(model: torch.nn.Module, loader: Any, limit: int) -> Tensor:
    """``(n, d)`` hidden states of the first ``limit`` samples of ``loader`` (fewer if it ends);
    positions without a target (padding) are left out."""
    model.eval()
    chunks, seen = [], 0
    for batch in loader:
        keep = (batch[model.target_key].reshape(-1) != -100).to(model.device)
        chunks.append(batch_hidden(model, batch).reshape(-1, model.head.in_features)[keep])
        seen += chunks[-1].shape[0]
        if seen >= limit:
            break
    return torch.cat(chunks)[:limit]


@torch.no_grad()
def head_latency(
    heads: dict[str, tuple[torch.nn.Module, Tensor]], batch_size: int, repeats: int, warmup: int = 1
) -> dict[str, dict[str, float]]:
    """Milliseconds per sample of ``head.topk(h, 1)``: one sample at a time and in batches.

    ``heads`` maps a name to ``(head, hidden)``; every head is timed on its own hidden states,
    interleaved repeat by repeat with the others (medians over ``repeats``).
    """
    steps = {}
    for name, (head, hidden) in heads.items():
        head.eval()
        singles = list(hidden.split(1))
        batches = list(hidden.split(batch_size))
        steps[(name, "single")] = lambda head=head, xs=singles: [head.topk(x, 1) for x in xs]
        steps[(name, "batch")] = lambda head=head, xs=batches: [head.topk(x, 1) for x in xs]
    times = interleaved_times(steps, warmup, repeats)
    result = {}
    for name, (_, hidden) in heads.items():
        n = hidden.shape[0]
        result[name] = {
            "single_ms": summarize(times[(name, "single")])["median"] * 1e3 / n,
            "batch_per_sample_ms": summarize(times[(name, "batch")])["median"] * 1e3 / n,
        }
    return result


def save_heatmap(mask: Tensor, order: Tensor, path: str) -> None:
    """Expert x class kept-mask image, classes in ``order``, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, max(2.0, mask.shape[0] * 0.15)))
    ax.imshow(mask[:, order].float().numpy(), aspect="auto", interpolation="nearest", cmap="Greys")
    ax.set_xlabel("class (grouped by super-class)")
    ax.set_ylabel("expert")
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    write_output(path, image.getvalue(), "--output_dir")


def default_output_dir(ckpt_path: str) -> str:
    """Where the reports go without ``--output_dir``: ``analyze/`` in the run's version directory
    for a checkpoint in its ``checkpoints/`` (``runs/X/version_0/checkpoints/last.ckpt`` ->
    ``runs/X/version_0/analyze``), so the checkpoint directory holds checkpoints only; else the
    checkpoint's own directory."""
    directory = os.path.dirname(os.path.abspath(ckpt_path))
    if os.path.basename(directory) == "checkpoints":
        return os.path.join(os.path.dirname(directory), "analyze")
    return directory


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app analyze experts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="checkpoint of a task with a DS-Softmax head (any task)")
    parser.add_argument("--split", choices=("train", "val", "test"), default="test")
    add_config_argument(parser)
    parser.add_argument("--output_dir", default=None,
                        help="where to write experts.json and heatmap.png (default: the run's version directory's analyze/, "
                             "runs/X/version_N/analyze for runs/X/version_N/checkpoints/last.ckpt; beside a checkpoint "
                             "kept elsewhere)")
    parser.add_argument("--num_smallest", type=int, default=3, help="class lists of this many smallest experts (App. C)")
    parser.add_argument("--reference_ckpt", default=None,
                        help="checkpoint of the same task with another head (e.g. full softmax): also time both heads' top-1")
    parser.add_argument("--reference_head", default=None,
                        help="instead of --reference_ckpt: time an untrained head of this name (e.g. softmax) of the same shape")
    parser.add_argument("--latency_samples", type=int, default=512, help="samples whose hidden states are timed")
    parser.add_argument("--latency_batch", type=int, default=256, help="batch size of the batched timing")
    parser.add_argument("--latency_repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads while timing (1: the latency setting)")
    args = parser.parse_args(argv)
    for name in ("latency_samples", "latency_batch", "latency_repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.reference_ckpt is not None and args.reference_head is not None:
        parser.error("--reference_ckpt and --reference_head both given: pass one (a trained model, or a head name to time)")
    if args.reference_head is not None and args.reference_head not in available_heads():
        parser.error(f"--reference_head {args.reference_head!r} is not a head; choose one of {', '.join(available_heads())}")
    out_dir = args.output_dir or default_output_dir(args.ckpt_path)
    # before the analysis runs, not after it: an unwritable directory is one line at once
    check_writable_directory(out_dir, "output_dir")
    model, datamodule = restore(args.ckpt_path, default_task=DEFAULT_TASK, config=args.config)
    datamodule.setup("test")
    loader = {"train": datamodule.train_dataloader, "val": datamodule.val_dataloader, "test": datamodule.test_dataloader}[args.split]()
    super_class_of = datamodule.super_class_of if isinstance(datamodule, ClassHierarchy) else None
    stats = expert_statistics(model, loader, super_class_of)
    order = SparsityTracker.class_order(model.head.num_classes, None) if super_class_of is None else torch.argsort(torch.as_tensor(super_class_of), stable=True)
    save_heatmap(stats["mask"], order, os.path.join(out_dir, "heatmap.png"))
    names = datamodule.class_names
    smallest = torch.argsort(stats["mask"].sum(1), stable=True)[: args.num_smallest].tolist()
    stats["smallest_experts"] = {int(k): [names[c] for c in stats["mask"][k].nonzero().squeeze(1).tolist()[:50]] for k in smallest}
    if args.reference_ckpt is not None or args.reference_head is not None:
        torch.set_num_threads(args.threads)
        ds_hidden = hidden_states(model, loader, args.latency_samples)
        if args.reference_ckpt is not None:
            reference, _ = restore(args.reference_ckpt, default_task=DEFAULT_TASK, config=args.config)
            if reference.head.num_classes != model.head.num_classes:
                raise ValueError(
                    f"--reference_ckpt {args.reference_ckpt} has {reference.head.num_classes} classes but {args.ckpt_path} has "
                    f"{model.head.num_classes}; pass a checkpoint of the same task and class set"
                )
            reference_head, reference_hidden = reference.head, hidden_states(reference, loader, args.latency_samples)
        else:
            reference_head = create_head(args.reference_head, model.head.in_features, model.head.num_classes)
            reference_hidden = ds_hidden
        names_to_heads = {"reference": (reference_head, reference_hidden), "ds": (model.head, ds_hidden)}
        latency = head_latency(names_to_heads, args.latency_batch, args.latency_repeats)
        stats["latency"] = {
            "reference_head": type(reference_head).__name__, "reference_trained": args.reference_ckpt is not None,
            "threads": args.threads,
            "samples": int(names_to_heads["ds"][1].shape[0]), "batch": args.latency_batch, **{
                f"{name}_{key}": value for name, row in latency.items() for key, value in row.items()
            },
            "single_speedup": latency["reference"]["single_ms"] / latency["ds"]["single_ms"],
            "batch_speedup": latency["reference"]["batch_per_sample_ms"] / latency["ds"]["batch_per_sample_ms"],
        }
    report = {k: v for k, v in stats.items() if k not in ("routing", "mask")}
    write_output(os.path.join(out_dir, "experts.json"), json.dumps(report, indent=1), "--output_dir")
    for key in ("num_experts", "purity", "expert_purity", "coverage", "kept_fraction", "theoretical_speedup", "flops_reduction"):
        if key in report:
            value = report[key]
            print(f"{key:>20}: {value:.4f}" if isinstance(value, float) else f"{key:>20}: {value}")
    print(f"{'redundancy':>20}: {report['redundancy_histogram']}")
    print(f"{'utilisation':>20}: {report['utilisation']}")
    if "latency" in report:
        lat = report["latency"]
        print(
            f"{'head top-1 latency':>20}: one sample {lat['ds_single_ms']:.4f} ms vs "
            f"{lat['reference_head']}{'' if lat['reference_trained'] else ' (untrained, same shape)'} "
            f"{lat['reference_single_ms']:.4f} ms ({lat['single_speedup']:.2f}x); batch of {lat['batch']} "
            f"{lat['ds_batch_per_sample_ms']:.4f} vs {lat['reference_batch_per_sample_ms']:.4f} ms per sample "
            f"({lat['batch_speedup']:.2f}x); FLOPs reduction {report['flops_reduction']:.2f}x ({lat['threads']} thread(s))"
        )
    for k, classes in report["smallest_experts"].items():
        print(f"expert {k}: {' '.join(classes)}")
    print(f"wrote {os.path.join(out_dir, 'experts.json')} and heatmap.png")
    return 0
