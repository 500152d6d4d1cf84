"""``python -m app bench ds``: DS-Softmax sparse inference vs full softmax, measured in one run.

Both heads answer ``topk(hidden, k)`` on the same random contexts (d = 200, V = 10,000 by
default), one context at a time (latency) and in batches (throughput). The DS-Softmax head is
either loaded from a checkpoint (``--ckpt_path``: the structure the training produced) or
given a pruned structure here: every class is kept by ``--redundancy`` experts on average
(at least one), built in its compact form by :func:`heads.ds.build.pruned_head`, so the
benchmark runs the exact inference path a trained model would.
The FLOPs reduction ``V / (K + mean_k n_k)`` (uniform routing) is printed next to the
measured speed-up. With ``--ckpt_path`` alone the contexts are still random, so a trained gate
routes them as it would no real context.

On a trained model's own contexts (``--softmax_ckpt``): the hidden states of the test split
(``--split``) that a trained full-softmax checkpoint's encoder computes, as ``test`` computes them,
answered by every post-processing baseline built from that softmax and by the DS heads
(:func:`compare_on_checkpoint`, rows in ``docs/ds_softmax.md``): the exact ``Softmax.topk``, the
plain yardstick (one gemv / gemm against a contiguous ``(d, V)`` copy of the weight, max,
logsumexp), SVD-softmax, a FAISS HNSW graph over the class embeddings with the bias folded in as
one more dimension (and, with ``--flat_ip``, FAISS's exact inner-product scan), the DS head
screened from the softmax as ``convert ds`` screens it (or ``--screened_ckpt``), and a trained
DS checkpoint (``--ckpt_path``, on its own encoder's hidden states of the same tokens). Each row
gives top-1 / top-5 agreement with the exact answer, top-1 accuracy on the next token, and the
latency of one context and of a batch, timed interleaved repeat by repeat (medians); every
speed-up is against the exact ``Softmax.topk`` of the same run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch
from torch import Tensor

from app.checkpoint_io import read_checkpoint, restore
from app.tools.common import (
    DEFAULT_TASK, add_config_argument, apply_tiny, check_report_files, interleaved_times, summarize, write_reports,
)
from heads.ds import DSSoftmax
from heads.ds.build import pruned_head as build_pruned_head
from heads.ds.build import random_kept_mask
from heads.softmax import Softmax
from heads.svd_softmax import SVDSoftmax

#: What to install for the FAISS rows (the ``ann`` extra of pyproject.toml).
ANN_EXTRA = "pip install -e .[ann]"


def pruned_head(d: int, V: int, K: int, redundancy: float, seed: int) -> DSSoftmax:
    """A DS-Softmax with ``K`` experts each keeping about ``redundancy * V / K`` classes."""
    if redundancy < 1.0 or redundancy > K:
        raise ValueError(f"bench ds needs 1 <= redundancy <= num_experts={K}, got {redundancy} (set --redundancy)")
    generator = torch.Generator().manual_seed(seed)
    keep = random_kept_mask(K, V, redundancy, generator)
    gate = torch.randn(K, d, generator=generator)
    rows = torch.randn(int(keep.sum()), d, generator=generator)
    return build_pruned_head(keep, gate, rows=rows).eval()


def checkpoint_head(path: str, checkpoint: dict, structure: dict, config: list[str] | None = None) -> DSSoftmax:
    """The DS-Softmax head of a checkpoint. A checkpoint of a run names its task: the model is
    restored (:func:`app.checkpoint_io.restore`) and
    its head taken. A checkpoint holding only a head (``head.*`` weights, ``head_structure`` and the
    head's ``init_args``) is rebuilt from those."""
    names_task = (checkpoint.get("hyper_parameters") or {}).get("_class_path") or (checkpoint.get("headbench") or {}).get("task")
    if names_task:
        model, _ = restore(path, checkpoint, data=False, config=config)
        return model.head
    weights = {k[len("head."):]: v for k, v in checkpoint["state_dict"].items() if k.startswith("head.")}
    # the head's own options (class bias, gate scale, ...) as the run configured them
    options = dict((checkpoint.get("hyper_parameters", {}).get("head") or {}).get("init_args", {}))
    options.update(num_experts=structure["num_experts"], class_bias="class_bias" in weights)
    head = DSSoftmax(structure["in_features"], structure["num_classes"], **options)
    try:
        head.load_structure(structure)
        head.load_state_dict(weights)
    except ValueError as error:  # the head's own words (an edited structure or index buffer), the file's name
        raise ValueError(f"checkpoint {path}: {' '.join(str(error).split())}") from None
    return head


def time_calls(fn, inputs: list[torch.Tensor], repeats: int) -> float:
    """Best-of-``repeats`` mean seconds per call over ``inputs``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for x in inputs:
            fn(x)
        best = min(best, (time.perf_counter() - start) / len(inputs))
    return best


# ---------------------------------------------------------------------------- on a trained model's own contexts
class PlainSoftmax:
    """The yardstick of the exact path: the logits by one gemv (one context) or gemm against a
    contiguous ``(d, V)`` copy of a :class:`Softmax`'s weight made once, the row maximum
    (``k = 1``) or top-k, minus ``logsumexp``; nothing else.

    Shape:
        ``topk``: hidden ``(N, in_features)`` -> ``(log_probs, indices)``, each ``(N, k)``.
    """

    def __init__(self, head: Softmax) -> None:
        self.head = head
        self.columns = head.decoder.weight.detach().t().contiguous()  # (d, V)
        self.bias = None if head.decoder.bias is None else head.decoder.bias.detach()

    def topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        h = self.head.latent(hidden) if self.head.projection is not None else hidden  # (N, d)
        if h.shape[0] == 1:  # gemv
            logits = (torch.mv(self.columns.t(), h[0]) if self.bias is None else torch.addmv(self.bias, self.columns.t(), h[0])).unsqueeze(0)
        else:  # gemm
            logits = h @ self.columns if self.bias is None else torch.addmm(self.bias, h, self.columns)  # (N, V)
        values, indices = logits.max(1, keepdim=True) if k == 1 else logits.topk(k, dim=1)
        return values - logits.logsumexp(1, keepdim=True), indices


def import_faiss() -> Any | None:
    """The ``faiss`` module, or None when the optional ``ann`` extra is not installed."""
    try:
        import faiss
    except ImportError:
        return None
    return faiss


#: The FAISS indexes :class:`InnerProductIndex` builds.
INDEX_KINDS = ("hnsw", "hnsw_l2", "flat")


class InnerProductIndex:
    """A FAISS index over a :class:`Softmax`'s class embeddings that answers its top-k logits.

    Class ``c`` is stored as ``x_c = [w_c; b_c]`` and a query is ``[h; 1]``: the bias folded in as
    one more dimension, so the inner product is the logit ``w_c . h + b_c``. Kinds:

    * ``hnsw``: ``IndexHNSWFlat`` searched by inner product (``M`` links per node,
      ``efConstruction`` / ``efSearch`` the candidate lists when building and searching). A
      graph built on inner products is a poor one where the item norms differ (a unigram bias
      makes them differ), so its answers can miss the top logit at any ``efSearch``;
    * ``hnsw_l2``: the same graph in Euclidean distance after the reduction of maximum inner
      product search to nearest-neighbour search (Bachrach et al., RecSys 2014, §3): items get
      one more coordinate ``sqrt(R^2 - |x_c|^2)`` (``R`` the largest ``|x_c|``), queries a 0, so
      ``|q - x_c|^2 = |q|^2 + R^2 - 2 q . x_c`` ranks the classes as their logits do;
    * ``flat``: ``IndexFlatIP``, an exact scan.

    ``topk`` returns the logits of the classes found (not log-probabilities: an index has no
    normaliser).

    Shape:
        ``topk``: hidden ``(N, in_features)`` -> ``(logits, indices)``, each ``(N, k)``.
    """

    def __init__(self, faiss: Any, head: Softmax, kind: str = "hnsw", M: int = 32, ef_construction: int = 200,
                 ef_search: int = 128) -> None:
        assert kind in INDEX_KINDS, kind
        self.head, self.kind, self.with_bias = head, kind, head.decoder.bias is not None
        with torch.no_grad():
            items = head.decoder.weight.detach().float()  # (V, d)
            if self.with_bias:
                items = torch.cat([items, head.decoder.bias.detach().float().unsqueeze(1)], dim=1)  # (V, d + 1)
            norms = items.pow(2).sum(1)  # (V,)
            self.radius_squared = float(norms.max())
            if kind == "hnsw_l2":
                items = torch.cat([items, (self.radius_squared - norms).clamp_min(0).sqrt().unsqueeze(1)], dim=1)  # (V, d' + 1)
        dim = items.shape[1]
        start = time.perf_counter()
        if kind == "flat":
            self.index = faiss.IndexFlatIP(dim)
        else:
            metric = faiss.METRIC_INNER_PRODUCT if kind == "hnsw" else faiss.METRIC_L2
            self.index = faiss.IndexHNSWFlat(dim, M, metric)
            self.index.hnsw.efConstruction = ef_construction
        self.index.add(items.contiguous().numpy())
        if kind != "flat":
            self.index.hnsw.efSearch = ef_search
        self.build_seconds = time.perf_counter() - start
        self.memory_bytes = int(faiss.serialize_index(self.index).nbytes)  # vectors and graph links

    def topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        h = self.head.latent(hidden) if self.head.projection is not None else hidden  # (N, d)
        columns = [h, h.new_ones(h.shape[0], 1)] if self.with_bias else [h]
        if self.kind == "hnsw_l2":
            columns.append(h.new_zeros(h.shape[0], 1))
        query = torch.cat(columns, dim=1).float().contiguous()  # (N, dim)
        scores, ids = self.index.search(query.numpy(), k)
        scores = torch.from_numpy(scores)
        if self.kind == "hnsw_l2":  # squared distances back to inner products (the logits)
            scores = (query.pow(2).sum(1, keepdim=True) + self.radius_squared - scores) / 2
        return scores, torch.from_numpy(ids)


def agreement(indices: Tensor, exact: Tensor, targets: Tensor) -> dict[str, float]:
    """Top-1 equality and mean top-k overlap with the exact ``(n, k)`` answer, and top-1 accuracy
    on the true next classes ``targets (n,)``."""
    overlap = (indices.unsqueeze(2) == exact.unsqueeze(1)).any(2).float().sum(1) / exact.shape[1]  # (n,)
    return {
        "top1_agreement": float((indices[:, 0] == exact[:, 0]).float().mean()),
        "topk_agreement": float(overlap.mean()),
        "accuracy": float((indices[:, 0] == targets).float().mean()),
    }


def answers(method: Any, hidden: Tensor, k: int, chunk: int = 1024) -> Tensor:
    """``(n, k)`` top-k classes of ``method`` for every context, in chunks (no ``(n, V)`` buffer)."""
    return torch.cat([method.topk(part, k)[1] for part in hidden.split(chunk)])


def routed_flops_reduction(head: DSSoftmax, hidden: Tensor) -> float:
    """``V / (K + mean n_k*)``: the full softmax's multiply-adds over the gate's and the chosen experts' on these contexts."""
    expert, _ = head.route(hidden)
    return head.num_classes / (head.num_experts + float(head.rows_per_expert()[expert].float().mean()))


def checkpoint_contexts(path: str, config: list[str], split: str, limit: int) -> tuple[Any, Tensor, Tensor]:
    """The model of a run's checkpoint and the hidden states ``(n, d)`` and next classes ``(n,)`` of
    the first ``limit`` tokens of its ``split``, as ``test`` computes them."""
    from app.convert.ds import task_contexts

    model, datamodule = restore(path, default_task=DEFAULT_TASK, config=config)
    datamodule.setup("fit" if split in ("train", "val") else "test")
    loader = {"train": datamodule.train_dataloader, "val": datamodule.val_dataloader, "test": datamodule.test_dataloader}[split]()
    hidden, targets = task_contexts(model, loader, limit)
    return (model, datamodule), hidden, targets


def rotated_times(steps: dict[Any, Callable[[], object]], warmup: int, repeats: int) -> dict[Any, list[float]]:
    """:func:`app.tools.common.interleaved_times`, the order of the steps turned by one place every
    round: no step always runs first, after the same neighbour (a step that follows a batch of
    another method finds the caches holding that method's data)."""
    names = list(steps)
    interleaved_times(steps, warmup, 0)  # the warm-up rounds, not recorded
    times: dict[Any, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        turn = round_ % len(names)
        for name, measured in interleaved_times({n: steps[n] for n in names[turn:] + names[:turn]}, 0, 1).items():
            times[name] += measured
    return times


def compare_on_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    """Every row of the comparison on the softmax checkpoint's own contexts (module docstring)."""
    (model, datamodule), hidden, targets = checkpoint_contexts(args.softmax_ckpt, args.config, args.split, args.contexts)
    softmax = model.head.eval()
    if type(softmax) is not Softmax:
        raise ValueError(
            f"bench ds --softmax_ckpt needs a checkpoint whose head is a full softmax (heads.Softmax), got "
            f"{type(softmax).__name__} in {args.softmax_ckpt}: pass a DS-Softmax checkpoint as --ckpt_path"
        )
    d, V = softmax.in_features, softmax.num_classes
    if args.k > V:
        raise ValueError(f"--k {args.k} is more than the {V} classes of {args.softmax_ckpt}: use a smaller --k")
    # (name, answerer, its contexts and next classes, what the note column says)
    rows: list[tuple[str, Any, Tensor, Tensor, str]] = [
        ("exact softmax (Softmax.topk)", softmax, hidden, targets, ""),
        ("yardstick: gemv/gemm + max + logsumexp", PlainSoftmax(softmax), hidden, targets, "W^T contiguous"),
    ]
    svd = SVDSoftmax.from_softmax(softmax, args.svd_preview_fraction, args.svd_candidates).eval()
    rows.append((f"SVD-softmax (preview {svd.preview_width}/{svd.rank}, N={svd.num_candidates})", svd, hidden, targets, ""))
    skipped = []
    faiss = import_faiss()
    if faiss is None:
        skipped.append(f"FAISS rows skipped: faiss is not installed ({ANN_EXTRA})")
    else:
        faiss.omp_set_num_threads(args.threads)
        for kind in ("hnsw", "hnsw_l2") if args.hnsw_metric == "both" else ("hnsw" if args.hnsw_metric == "ip" else "hnsw_l2",):
            hnsw = InnerProductIndex(faiss, softmax, kind, args.hnsw_m, args.ef_construction, args.ef_search)
            what = "inner product" if kind == "hnsw" else "L2 after the MIPS transform"
            rows.append((f"HNSW {what} (faiss, M={args.hnsw_m}, efSearch={args.ef_search})", hnsw, hidden, targets,
                         f"build {hnsw.build_seconds:.2f} s, index {hnsw.memory_bytes / 2**20:.2f} MiB"))
        if args.flat_ip:
            flat = InnerProductIndex(faiss, softmax, "flat")
            rows.append(("FAISS IndexFlatIP (exact scan)", flat, hidden, targets, f"index {flat.memory_bytes / 2**20:.2f} MiB"))
    if args.screened_ckpt:
        (screened_model, _), screened_hidden, screened_targets = checkpoint_contexts(args.screened_ckpt, args.config, args.split, args.contexts)
        screened, how = screened_model.head.eval(), f"from {args.screened_ckpt}"
        if not isinstance(screened, DSSoftmax) or not torch.equal(screened_targets, targets):
            raise ValueError(f"--screened_ckpt {args.screened_ckpt} is not a DS-Softmax checkpoint of the same task and data (write it with convert ds)")
        rows.append((f"DS-{screened.num_experts} screened (convert ds)", screened, screened_hidden, targets, how))
    elif args.screen_experts:
        if softmax.projection is not None:
            skipped.append("screened DS row skipped: convert ds screens a softmax without a projection")
        else:
            from app.convert.ds import screen_model

            screened, report = screen_model(model, datamodule, args.screen_experts, args.screen_flops_reduction, None,
                                            max_tokens=args.screen_tokens, seed=args.seed, where=args.softmax_ckpt)
            screened.eval()
            rows.append((f"DS-{screened.num_experts} screened (convert ds)", screened, hidden, targets,
                         f"screened on {report['screening_tokens']} training tokens"))
    if args.ckpt_path:
        (trained_model, _), trained_hidden, trained_targets = checkpoint_contexts(args.ckpt_path, args.config, args.split, args.contexts)
        trained = trained_model.head.eval()
        if not isinstance(trained, DSSoftmax) or trained.num_classes != V or not torch.equal(trained_targets, targets):
            raise ValueError(
                f"--ckpt_path {args.ckpt_path} is not a DS-Softmax checkpoint of the same task and data as {args.softmax_ckpt} "
                f"(head {type(trained).__name__}, {trained.num_classes} classes): pass one trained with a DS-Softmax head on the same data"
            )
        rows.append((f"DS-{trained.num_experts} trained", trained, trained_hidden, targets, "its own encoder's contexts"))

    k_agree = min(5, V)
    with torch.inference_mode():
        exact = answers(PlainSoftmax(softmax), hidden, k_agree)  # the exact answer, by the yardstick
        results = []
        for name, method, h, y, note in rows:
            if isinstance(method, DSSoftmax):
                note = f"{note}; FLOPs reduction {routed_flops_reduction(method, h):.2f}x"
            results.append({"method": name, "note": note.strip("; "), **agreement(answers(method, h, k_agree), exact, y)})
        steps: dict[tuple[str, str], Callable[[], object]] = {}
        batch = min(args.batch_size, hidden.shape[0])
        num_batches = max(1, min(args.batches, hidden.shape[0] // batch))
        num_singles = min(args.samples, hidden.shape[0])
        for name, method, h, _, _ in rows:
            singles = list(h[:num_singles].split(1))
            batches = list(h[: num_batches * batch].split(batch))
            steps[(name, "single")] = lambda m=method, xs=singles: [m.topk(x, args.k) for x in xs]
            steps[(name, "batch")] = lambda m=method, xs=batches: [m.topk(x, args.k) for x in xs]
        times = rotated_times(steps, args.warmup, args.repeats)
    for row in results:
        row["single_us"] = summarize(times[(row["method"], "single")])["median"] * 1e6 / num_singles
        row["batch_ms"] = summarize(times[(row["method"], "batch")])["median"] * 1e3 / num_batches
    base = results[0]
    for row in results:  # every speed-up against the exact path of this run
        row["single_speedup"] = base["single_us"] / row["single_us"]
        row["batch_speedup"] = base["batch_ms"] / row["batch_ms"]
    return {
        "setting": {
            "softmax_ckpt": args.softmax_ckpt, "split": args.split, "d": d, "V": V, "contexts": int(hidden.shape[0]),
            "k": args.k, "agreement_k": k_agree, "threads": args.threads, "singles": num_singles, "batch_size": batch,
            "batches": num_batches, "repeats": args.repeats, "warmup": args.warmup,
            "exact_over_yardstick_single": results[1]["single_speedup"], "exact_over_yardstick_batch": results[1]["batch_speedup"],
        },
        "rows": results,
        "skipped": skipped,
    }


#: How much slower than the yardstick the exact path may be.
EXACT_LIMIT = 1.2


def format_comparison(result: dict[str, Any]) -> str:
    """The comparison as a markdown table with its setting above and the exact path's check below."""
    s = result["setting"]
    k = s["agreement_k"]
    lines = [
        f"bench ds on the {s['split']} contexts of {s['softmax_ckpt']}: d={s['d']}, V={s['V']}, {s['contexts']} tokens "
        f"(agreement with the exact top-{k}, accuracy on the next token); top-{s['k']} timed on {s['singles']} single contexts "
        f"and {s['batches']} batches of {s['batch_size']}, {s['threads']} thread(s), median of {s['repeats']} interleaved "
        f"repeats ({s['warmup']} warm-up dropped); speed-ups against the exact softmax of this run",
        "",
        f"| method | top-1 agree | top-{k} agree | acc@1 | one context µs | speed-up | batch of {s['batch_size']} ms | speed-up | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['method']} | {100 * r['top1_agreement']:.2f}% | {100 * r['topk_agreement']:.2f}% | {100 * r['accuracy']:.2f}% "
            f"| {r['single_us']:.1f} | {r['single_speedup']:.2f}x | {r['batch_ms']:.3f} | {r['batch_speedup']:.2f}x | {r['note']} |"
        )
    single, batch = s["exact_over_yardstick_single"], s["exact_over_yardstick_batch"]
    met = "within" if max(single, batch) <= EXACT_LIMIT else "NOT within"
    lines += ["", f"exact softmax / yardstick time: one context {single:.2f}x, batch {batch:.2f}x ({met} {EXACT_LIMIT}x)"]
    lines += result["skipped"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app bench ds", description=__doc__.split("\n\n")[0])
    parser.add_argument("--in_features", type=int, default=200)
    parser.add_argument("--num_classes", type=int, default=10_000)
    parser.add_argument("--num_experts", type=int, default=64)
    parser.add_argument("--redundancy", type=float, default=1.5, help="mean number of experts keeping a class")
    parser.add_argument("--ckpt_path", default=None, help="use the DS-Softmax head of this checkpoint instead")
    parser.add_argument("--k", type=int, default=1)
    add_config_argument(parser)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--samples", type=int, default=2000, help="single contexts timed")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="small sizes for tests; options given explicitly win")
    parser.add_argument("--seed", type=int, default=0)
    own = parser.add_argument_group("on a trained model's own contexts (--softmax_ckpt)")
    own.add_argument("--softmax_ckpt", default=None,
                     help="checkpoint of a task with a full softmax head: compare every baseline on its own hidden states "
                          "(--ckpt_path then names a trained DS-Softmax checkpoint of the same task and data)")
    own.add_argument("--split", choices=("train", "val", "test"), default="test")
    own.add_argument("--contexts", type=int, default=0, help="tokens of the split scored for agreement and accuracy (0: all)")
    own.add_argument("--warmup", type=int, default=1, help="timing rounds run but not recorded")
    own.add_argument("--svd_preview_fraction", type=float, default=0.1, help="SVD-softmax preview width (share of d + 1)")
    own.add_argument("--svd_candidates", type=int, default=None, help="SVD-softmax N, classes recomputed exactly (default 5%% of V)")
    own.add_argument("--hnsw_m", type=int, default=32, help="HNSW links per node (faiss IndexHNSWFlat M)")
    own.add_argument("--ef_construction", type=int, default=200, help="HNSW candidate list while building")
    own.add_argument("--ef_search", type=int, default=128, help="HNSW candidate list while searching (>= the k searched)")
    own.add_argument("--hnsw_metric", choices=("ip", "l2", "both"), default="both",
                     help="HNSW searched by inner product, in L2 after the MIPS-to-nearest-neighbour transform, or both rows")
    own.add_argument("--flat_ip", action="store_true", help="also FAISS's exact inner-product scan (IndexFlatIP)")
    own.add_argument("--screened_ckpt", default=None, help="a convert ds checkpoint of the softmax instead of screening here")
    own.add_argument("--screen_experts", type=int, default=16, help="experts of the DS head screened here as convert ds does (0: no such row)")
    own.add_argument("--screen_flops_reduction", type=float, default=10.0, help="FLOPs reduction the screening aims at")
    own.add_argument("--screen_tokens", type=int, default=1_000_000, help="training tokens to screen on (a random subset)")
    own.add_argument("--json", default=None, help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    check_report_files(args)  # before anything is measured
    if args.softmax_ckpt:
        for name in ("batch_size", "samples", "batches", "repeats", "threads", "k", "hnsw_m", "ef_construction", "ef_search", "screen_tokens"):
            if getattr(args, name) < 1:
                parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
        for name in ("contexts", "warmup", "screen_experts"):
            if getattr(args, name) < 0:
                parser.error(f"--{name} must be >= 0, got {getattr(args, name)}")
        args.contexts = args.contexts or 2**62
        torch.set_num_threads(args.threads)
        torch.manual_seed(args.seed)
        result = compare_on_checkpoint(args)
        print(format_comparison(result))
        write_reports(result, args.json)
        return 0
    if args.tiny:  # options given explicitly win
        apply_tiny(parser, argv, args, dict(in_features=16, num_classes=200, num_experts=8, samples=20, batches=2, batch_size=16, repeats=1))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.ckpt_path:
        checkpoint = read_checkpoint(args.ckpt_path)
        structure = checkpoint.get("head_structure")
        saved_head = (checkpoint.get("headbench") or {}).get("head")
        if structure is None or not (saved_head is None or saved_head == f"{DSSoftmax.__module__}.{DSSoftmax.__qualname__}"):
            raise ValueError(
                f"checkpoint {args.ckpt_path} has no DS-Softmax head (head {saved_head or 'unknown'}, "
                f"{'no' if structure is None else 'a'} head_structure): pass a checkpoint trained with a DS-Softmax head"
            )
        try:
            ds = checkpoint_head(args.ckpt_path, checkpoint, structure, args.config).eval()
        except (KeyError, TypeError, RuntimeError) as error:
            reason = " ".join(str(error).split())[:160]
            raise ValueError(
                f"checkpoint {args.ckpt_path} holds a DS-Softmax head that cannot be rebuilt ({type(error).__name__}: {reason}): "
                f"it is damaged or was edited; pass a checkpoint written by python -m app fit"
            ) from None
        args.in_features, args.num_classes = ds.in_features, ds.num_classes
    else:
        ds = pruned_head(args.in_features, args.num_classes, args.num_experts, args.redundancy, args.seed)
    full = Softmax(args.in_features, args.num_classes).eval()
    d, V, K = args.in_features, args.num_classes, ds.num_experts
    rows = ds.rows_per_expert().float()
    flops_reduction = V / (K + float(rows.mean()))
    singles = [torch.randn(1, d) for _ in range(args.samples)]
    batches = [torch.randn(args.batch_size, d) for _ in range(args.batches)]
    results = []
    with torch.inference_mode():
        for name, inputs, per in (("single context", singles, 1), (f"batch of {args.batch_size}", batches, args.batch_size)):
            for x in inputs[:3]:  # warm-up (caches, allocator)
                full.topk(x, args.k), ds.topk(x, args.k)
            t_full = time_calls(lambda x: full.topk(x, args.k), inputs, args.repeats) / per
            t_ds = time_calls(lambda x: ds.topk(x, args.k), inputs, args.repeats) / per
            results.append((name, t_full, t_ds))
    print(f"DS-Softmax inference benchmark: d={d}, V={V}, K={K}, top-{args.k}, threads={args.threads}, "
          f"mean kept classes per expert={float(rows.mean()):.1f}, "
          f"mean redundancy={float(rows.sum()) / V:.2f}, head memory DS {ds.memory_bytes() / 2**20:.2f} MiB "
          f"vs full {sum(p.numel() * 4 for p in full.parameters()) / 2**20:.2f} MiB")
    print(f"| {'setting':<16} | {'full softmax ms/ctx':>19} | {'DS ms/ctx':>10} | {'speed-up':>8} | {'FLOPs reduction':>15} |")
    print(f"|{'-' * 18}|{'-' * 21}|{'-' * 12}|{'-' * 10}|{'-' * 17}|")
    for name, t_full, t_ds in results:
        print(f"| {name:<16} | {t_full * 1e3:>19.4f} | {t_ds * 1e3:>10.4f} | {t_full / t_ds:>7.2f}x | {flops_reduction:>14.2f}x |")
    return 0
