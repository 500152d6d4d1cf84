"""``python -m app bench infer``: top-1/top-k inference latency of full softmax, adaptive softmax,
DS-Softmax and SVD-softmax, with their agreement with the full softmax, measured in one run.

What is compared (all answer ``head.topk(hidden, k)``):

1. **A trained full softmax.** Contexts come from a synthetic hierarchy: ``T`` topics, each a
   random unit direction ``mu_t`` in ``R^d`` and a Zipf distribution over its own random subset
   of the classes; a context of topic ``t`` is ``h = mu_t * s + noise``. A bias-free
   :class:`heads.Softmax` is trained on (context, class) pairs with Adam for ``--train-steps``
   steps (the final training NLL is printed). Bias-free because DS-Softmax experts carry no
   bias, so every method scores the same ``W h`` logits.
2. **DS-Softmax (compact path),** :class:`heads.DSSoftmax` with ``K`` experts fitted to that
   softmax post hoc, the structure the DS paper's training converges to (§2.2, Eq. 4): the gate
   ``W^g`` holds the ``K`` centroids of spherical k-means over calibration contexts (so the
   Eq. 1 argmax is the nearest centroid); expert ``k`` keeps every class that appears in the
   softmax's top ``--keep-topk`` for a calibration context routed to ``k`` (all other rows are
   pruned); kept rows are the softmax's rows. The gate value scales an expert's logits (Eq. 2),
   which changes no ranking. The printed sparsity is the kept share of the ``K x V`` rows.
3. **SVD-softmax,** :meth:`heads.SVDSoftmax.from_softmax` of the same softmax with a 5% and a
   10% preview and several numbers ``N`` of exactly recomputed candidates.
4. **Adaptive softmax** (the registry's ``clustered`` heads), trained like the softmax on the
   same contexts: it cannot be fitted to a trained softmax, it is a model of its own. It needs
   class ids sorted by decreasing frequency and the hierarchy's ids are random, so it is trained
   on ids ranked by the hierarchy's exact class marginal and its answers are mapped back
   (:class:`FrequencyRanked`). Its FLOPs count the head softmax and, per context, the tail
   clusters its exact ``topk`` computes for the top-k (:meth:`heads.AdaptiveSoftmax.needed_tails`).

Timing: one context at a time (``--samples`` held-out contexts, the latency setting) and in
batches of ``--batch-size``; the methods are interleaved repeat by repeat (``--warmup`` rounds
dropped) so they share the machine's load; medians with min-max spread. Agreement: on the
held-out contexts, the share whose top-1 equals the full softmax's top-1, and the mean overlap of
the top-k sets. FLOPs per context are counted analytically from the sizes each method touches.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from app.tools.common import apply_tiny, check_report_files, interleaved_times, summarize, write_reports
from heads import AdaptiveSoftmax, DSSoftmax, Softmax, SVDSoftmax
from heads.base import OutputHead
from heads.ds.build import pruned_head
from heads.ds.kmeans import spherical_kmeans
from heads.registry import create_head, list_heads

#: Preset -> (d, V): the output layer of the seeds' settings (DS-Softmax paper: PTB d=200;
#: WikiText-2 V=33,278; One Billion Word with a 100k vocabulary; WMT with 32k BPE).
PRESETS = {
    "ptb": (200, 10_000),
    "wikitext2": (400, 33_278),
    "1b": (512, 100_000),
    "wmt": (512, 32_000),
}

COLUMNS = [
    "method", "top1_single_ms", "top1_single_min_ms", "top1_single_max_ms", "top1_single_speedup",
    "topk_single_ms", "topk_single_speedup", "batch_ms", "batch_per_sample_ms", "batch_speedup",
    "top1_agreement", "topk_agreement", "flops_per_context", "flops_reduction",
]


@dataclass
class Hierarchy:
    """Synthetic topic hierarchy the softmax is trained on."""

    topic_means: Tensor  # (T, d) unit directions scaled by the signal strength
    topic_classes: Tensor  # (T, m) class ids of each topic
    class_probs: Tensor  # (m,) Zipf distribution over a topic's classes
    noise: float

    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``n`` contexts ``(n, d)`` and their classes ``(n,)``."""
        T, m = self.topic_classes.shape
        topics = torch.randint(0, T, (n,), generator=generator)
        slots = torch.multinomial(self.class_probs, n, replacement=True, generator=generator)
        noise = torch.randn(n, self.topic_means.shape[1], generator=generator) * self.noise
        return self.topic_means[topics] + noise, self.topic_classes[topics, slots]


class FrequencyRanked:
    """A head trained on class ids ranked by decreasing frequency, answering in the data's ids.

    Args:
        head: the trained head; its class ``r`` is the data's class ``order[r]``.
        order: ``(V,)`` the data's class ids, most frequent first.
    """

    def __init__(self, head: OutputHead, order: Tensor) -> None:
        self.head, self.order = head, order

    def topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        values, ranks = self.head.topk(hidden, k)  # (n, k) each
        return values, self.order[ranks]


def make_hierarchy(d: int, V: int, topics: int, classes_per_topic: int, seed: int) -> Hierarchy:
    generator = torch.Generator().manual_seed(seed)
    means = F.normalize(torch.randn(topics, d, generator=generator), dim=1) * 3.0
    classes = torch.stack([torch.randperm(V, generator=generator)[:classes_per_topic] for _ in range(topics)])
    probs = 1.0 / torch.arange(1, classes_per_topic + 1, dtype=torch.float)
    return Hierarchy(means, classes, probs / probs.sum(), noise=1.0 / math.sqrt(d))


def train_head(head: OutputHead, data: Hierarchy, steps: int, batch: int, seed: int, rank: Tensor | None = None) -> float:
    """Train ``head`` with Adam on contexts of ``data`` (their classes renamed by ``rank``, a
    ``(V,)`` map, when given); puts it in eval mode and returns its last training NLL."""
    optimizer = torch.optim.Adam(head.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(seed + 1)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        hidden, target = data.sample(batch, generator)
        loss = head(hidden, target if rank is None else rank[target]).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    head.eval()
    return float(loss.detach())


def train_softmax(data: Hierarchy, d: int, V: int, steps: int, batch: int, seed: int) -> tuple[Softmax, float]:
    """A bias-free softmax trained with Adam; returns it (eval mode) and its last training NLL."""
    torch.manual_seed(seed)
    head = Softmax(d, V, bias=False)
    return head, train_head(head, data, steps, batch, seed)


def class_marginal(data: Hierarchy, V: int) -> Tensor:
    """``(V,)`` the probability of each class over contexts (topics are drawn uniformly)."""
    T, m = data.topic_classes.shape
    weights = (data.class_probs / T).expand(T, m).reshape(-1)  # (T * m,)
    return torch.zeros(V).index_add_(0, data.topic_classes.reshape(-1), weights)


def train_ranked(name: str, data: Hierarchy, d: int, V: int, steps: int, batch: int, seed: int) -> tuple[FrequencyRanked, float]:
    """The registered head ``name`` (its defaults) trained on class ids ranked by :func:`class_marginal`."""
    order = class_marginal(data, V).argsort(descending=True, stable=True)  # (V,) rank -> class id
    rank = torch.empty_like(order)
    rank[order] = torch.arange(V)  # class id -> rank
    torch.manual_seed(seed)
    head = create_head(name, d, V)
    return FrequencyRanked(head, order), train_head(head, data, steps, batch, seed, rank)


@torch.no_grad()
def ds_from_softmax(softmax: Softmax, calibration: Tensor, K: int, keep_topk: int, seed: int) -> DSSoftmax:
    """A compact DS-Softmax fitted to ``softmax`` on calibration contexts (see module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    V = softmax.num_classes
    centroids = spherical_kmeans(calibration, K, iterations=10, generator=generator)  # (K, d)
    expert = (calibration @ centroids.T).argmax(1)  # (n,) Eq. 1's argmax with W^g = centroids
    top = softmax.logits(calibration).topk(keep_topk, dim=1).indices  # (n, keep_topk)
    keep = torch.zeros(K, V, dtype=torch.bool)
    keep[expert.unsqueeze(1).expand_as(top), top] = True  # (K, V)
    unused = ~keep.any(1)
    keep[unused, 0] = True  # an expert no calibration context reached keeps one row (never empty)
    # a peaked gate (its value only rescales the expert's logits); rows are the softmax's own
    return pruned_head(keep, centroids * 10.0, class_rows=softmax.decoder.weight).eval()


def ds_flops(ds: DSSoftmax, hidden: Tensor) -> float:
    """Mean multiply-adds x 2 per context: the gate plus the chosen expert's kept rows."""
    expert, _ = ds.route(hidden)
    rows = ds.rows_per_expert()[expert].float().mean()
    return 2.0 * ds.in_features * (ds.num_experts + float(rows))


@torch.no_grad()
def adaptive_flops(head: AdaptiveSoftmax, hidden: Tensor, k: int) -> float:
    """Mean multiply-adds x 2 per context of the exact top-``k``: the head softmax, plus each tail
    cluster (projection and output matrix) for the share of contexts that compute it."""
    adaptive = head.adaptive
    d = adaptive.in_features
    needed = head.needed_tails(torch.log_softmax(adaptive.head(hidden), dim=-1), k).double().mean(0)  # (C,)
    tails = sum(share * down.out_features * (d + up.out_features) for share, (down, up) in zip(needed.tolist(), adaptive.tail))
    return 2.0 * (d * adaptive.head_size + tails)


def svd_flops(svd: SVDSoftmax) -> float:
    D, R = svd.in_features, svd.rank
    return 2.0 * (R * D + svd.num_classes * svd.preview_width + svd.num_candidates * R)


def agreement(head, hidden: Tensor, reference_top: Tensor, k: int) -> tuple[float, float]:
    """Top-1 equality and mean top-k overlap with the reference's ``(n, k)`` top classes."""
    indices = head.topk(hidden, k)[1]  # (n, k)
    top1 = float((indices[:, 0] == reference_top[:, 0]).float().mean())
    overlap = (indices.unsqueeze(2) == reference_top.unsqueeze(1)).any(2).float().sum(1) / k  # (n,)
    return top1, float(overlap.mean())


def run(args: argparse.Namespace) -> dict:
    d, V = args.in_features, args.num_classes
    data = make_hierarchy(d, V, args.topics, args.classes_per_topic, args.seed)
    torch.set_num_threads(args.train_threads)  # training is not timed: use every core
    softmax, train_nll = train_softmax(data, d, V, args.train_steps, args.train_batch, args.seed)
    ranked = {  # adaptive softmax: a model of its own, trained like the softmax
        name: train_ranked(name, data, d, V, args.train_steps, args.train_batch, args.seed)
        for name in list_heads("clustered", trainable=True)
    }
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed + 2)
    calibration, _ = data.sample(args.calibration, generator)
    test, _ = data.sample(max(args.samples, args.batch_size * args.batches), generator)
    methods: dict[str, object] = {"full softmax": softmax, **{name: model for name, (model, _) in ranked.items()}}
    ds = ds_from_softmax(softmax, calibration, args.num_experts, args.keep_topk, args.seed)
    methods[f"DS-{args.num_experts}"] = ds
    for fraction in args.preview_fractions:
        for n in args.candidates:
            svd = SVDSoftmax.from_softmax(softmax, preview_fraction=fraction, num_candidates=min(n, V))
            methods[f"SVD-{round(fraction * 100)} N={svd.num_candidates}"] = svd
    k = args.k
    singles = [test[i : i + 1] for i in range(args.samples)]
    batches = [test[i * args.batch_size : (i + 1) * args.batch_size] for i in range(args.batches)]

    def over(inputs: list[Tensor], head, kk: int):
        return lambda: [head.topk(x, kk) for x in inputs]

    with torch.inference_mode():
        reference_top = softmax.topk(test, k)[1]
        steps = {}
        for name, head in methods.items():
            steps[(name, "top1")] = over(singles, head, 1)
            steps[(name, "topk")] = over(singles, head, k)
            steps[(name, "batch")] = over(batches, head, 1)
        times = interleaved_times(steps, args.warmup, args.repeats)
        rows = []
        for name, head in methods.items():
            top1 = summarize([t / args.samples for t in times[(name, "top1")]])
            topk = summarize([t / args.samples for t in times[(name, "topk")]])
            batch = summarize([t / args.batches for t in times[(name, "batch")]])
            if isinstance(head, DSSoftmax):
                flops = ds_flops(head, test)
            elif isinstance(head, SVDSoftmax):
                flops = svd_flops(head)
            elif isinstance(head, FrequencyRanked) and isinstance(head.head, AdaptiveSoftmax):
                flops = adaptive_flops(head.head, test, k)
            else:
                flops = 2.0 * d * V
            a1, ak = agreement(head, test, reference_top, k)
            rows.append({
                "method": name, "top1_single_ms": top1["median"] * 1e3, "top1_single_min_ms": top1["min"] * 1e3,
                "top1_single_max_ms": top1["max"] * 1e3, "topk_single_ms": topk["median"] * 1e3,
                "batch_ms": batch["median"] * 1e3, "batch_per_sample_ms": batch["median"] * 1e3 / args.batch_size,
                "top1_agreement": a1, "topk_agreement": ak, "flops_per_context": flops,
            })
    base = rows[0]
    for row in rows:  # every ratio from the measured medians of this run
        row["top1_single_speedup"] = base["top1_single_ms"] / row["top1_single_ms"]
        row["topk_single_speedup"] = base["topk_single_ms"] / row["topk_single_ms"]
        row["batch_speedup"] = base["batch_ms"] / row["batch_ms"]
        row["flops_reduction"] = base["flops_per_context"] / row["flops_per_context"]
    kept = ds.rows_per_expert().sum().item()
    return {
        "setting": {
            "d": d, "V": V, "k": k, "threads": args.threads, "repeats": args.repeats, "warmup": args.warmup,
            "samples": args.samples, "batch_size": args.batch_size, "batches": args.batches,
            "topics": args.topics, "classes_per_topic": args.classes_per_topic, "train_steps": args.train_steps,
            "train_nll": train_nll, "ranked_train_nll": {name: nll for name, (_, nll) in ranked.items()},
            "calibration": args.calibration, "keep_topk": args.keep_topk,
            "num_experts": ds.num_experts, "ds_kept_rows": kept, "ds_sparsity": 1.0 - kept / (ds.num_experts * V),
            "ds_mean_rows_per_expert": kept / ds.num_experts,
        },
        "rows": rows,
    }


def format_markdown(result: dict) -> str:
    s = result["setting"]
    lines = [
        f"d={s['d']}, V={s['V']}, top-k k={s['k']}, threads={s['threads']}; softmax trained {s['train_steps']} Adam steps "
        f"on a {s['topics']}-topic hierarchy ({s['classes_per_topic']} classes/topic), final train NLL {s['train_nll']:.3f}; "
        + "".join(f"{name} trained alike on frequency-ranked ids, final train NLL {nll:.3f}; "
                  for name, nll in s["ranked_train_nll"].items())
        + f"DS-{s['num_experts']}: {s['ds_mean_rows_per_expert']:.0f} kept classes per expert on average, "
        f"sparsity {100 * s['ds_sparsity']:.2f}% of the K x V rows pruned (kept: softmax top-{s['keep_topk']} of "
        f"{s['calibration']} calibration contexts per expert); median of {s['repeats']} interleaved repeats "
        f"({s['warmup']} warm-up dropped), {s['samples']} single contexts, {s['batches']} batches of {s['batch_size']}",
        "",
        "| method | top-1 ms/ctx (min-max) | speed-up | top-k ms/ctx | speed-up | batch ms | ms/ctx in batch "
        "| speed-up | top-1 agree | top-k agree | MFLOP/ctx | FLOPs reduction |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['method']} | {r['top1_single_ms']:.4f} ({r['top1_single_min_ms']:.4f}-{r['top1_single_max_ms']:.4f}) "
            f"| {r['top1_single_speedup']:.2f}x | {r['topk_single_ms']:.4f} | {r['topk_single_speedup']:.2f}x "
            f"| {r['batch_ms']:.3f} | {r['batch_per_sample_ms']:.5f} | {r['batch_speedup']:.2f}x "
            f"| {100 * r['top1_agreement']:.2f}% | {100 * r['topk_agreement']:.2f}% "
            f"| {r['flops_per_context'] / 1e6:.3f} | {r['flops_reduction']:.2f}x |"
        )
    return "\n".join(lines)


def format_csv(result: dict) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS)
    writer.writeheader()
    for row in result["rows"]:
        writer.writerow({key: row[key] for key in COLUMNS})
    return out.getvalue()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app bench infer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="ptb", help="sets d and V (see PRESETS)")
    parser.add_argument("--in-features", type=int, default=None, help="d (overrides the preset)")
    parser.add_argument("--num-classes", type=int, default=None, help="V (overrides the preset)")
    parser.add_argument("--num-experts", type=int, default=64, help="K of DS-Softmax")
    parser.add_argument("--keep-topk", type=int, default=10, help="an expert keeps its contexts' softmax top-this classes")
    parser.add_argument("--topics", type=int, default=128, help="topics of the synthetic hierarchy")
    parser.add_argument("--classes-per-topic", type=int, default=None, help="default: V / 64")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--train-batch", type=int, default=256)
    parser.add_argument("--train-threads", type=int, default=torch.get_num_threads(), help="threads for the (untimed) training")
    parser.add_argument("--calibration", type=int, default=20_000, help="contexts used to fit the DS structure")
    parser.add_argument("--preview-fractions", default="0.05,0.1", help="SVD-softmax preview widths (share of d)")
    parser.add_argument("--candidates", default="0.01,0.05,0.1",
                        help="SVD-softmax N: integers, or fractions of V when < 1 (comma-separated)")
    parser.add_argument("--k", type=int, default=5, help="the k of top-k")
    parser.add_argument("--samples", type=int, default=500, help="single contexts timed per repeat")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the latency setting)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="tiny sizes for a quick check (tests): d=16, V=300 in place of the preset's; --in-features, --num-classes and other options given explicitly win")
    parser.add_argument("--csv", default=None, help="also write the table as CSV to this file")
    parser.add_argument("--json", default=None, help="also write the full results as JSON to this file")
    args = parser.parse_args(argv)
    check_report_files(args)  # before anything is measured
    if args.tiny:  # tiny d and V in place of the preset's; --in-features, --num-classes, --samples, ... given explicitly win
        apply_tiny(parser, argv, args, dict(
            in_features=16, num_classes=300, num_experts=8, topics=16, train_steps=30, train_batch=64, calibration=2000,
            samples=20, batch_size=16, batches=2, repeats=2))
    d, V = PRESETS[args.preset]
    args.in_features = args.in_features or d
    args.num_classes = args.num_classes or V
    args.classes_per_topic = args.classes_per_topic or max(2, args.num_classes // 64)
    for key in ("in_features", "num_classes", "num_experts", "keep_topk", "topics", "classes_per_topic", "train_batch",
                "calibration", "k", "samples", "batch_size", "batches", "repeats", "threads", "train_threads"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0 or args.train_steps < 0:
        parser.error(f"--warmup and --train-steps must be >= 0, got {args.warmup} and {args.train_steps}")
    if args.classes_per_topic > args.num_classes or args.k > args.num_classes:
        parser.error(f"--classes-per-topic and --k must be <= V={args.num_classes}")
    if args.num_experts > args.calibration:
        parser.error(f"--num-experts={args.num_experts} needs at least as many --calibration contexts")
    try:
        args.preview_fractions = [float(x) for x in args.preview_fractions.split(",") if x.strip()]
        values = [float(x) for x in args.candidates.split(",") if x.strip()]
    except ValueError as err:
        parser.error(f"--preview-fractions/--candidates must be comma-separated numbers ({err})")
    if not args.preview_fractions or any(not 0 < f <= 1 for f in args.preview_fractions):
        parser.error(f"--preview-fractions must be in (0, 1], got {args.preview_fractions}")
    args.candidates = sorted({max(args.k, math.ceil(v * args.num_classes)) if v < 1 else int(v) for v in values})
    if not args.candidates or args.candidates[0] < 1:
        parser.error(f"--candidates must be positive, got {values}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(args.threads)
    result = run(args)
    print(format_markdown(result))
    write_reports(result, args.json, args.csv, format_csv(result) if args.csv else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
