"""``python -m app bench ds``: DS-Softmax sparse inference vs full softmax, measured in one run.

Both heads answer ``topk(hidden, k)`` on the same random contexts (d = 200, V = 10,000 by
default), one context at a time (latency) and in batches (throughput). The DS-Softmax head is
either loaded from a checkpoint (``--ckpt_path``: the structure the training produced) or
given a pruned structure here: every class is kept by ``--redundancy`` experts on average
(at least one), built in its compact form by :func:`heads.ds.build.pruned_head`, so the
benchmark runs the exact inference path a trained model would.
The FLOPs reduction ``V / (K + mean_k n_k)`` (uniform routing) is printed next to the
measured speed-up. With ``--ckpt_path`` the contexts are still random, so a trained gate routes
them as it would no real context: for a trained model's latency on its own hidden states use
``python -m app analyze experts --ckpt_path X --reference_head softmax``.
"""

from __future__ import annotations

import argparse
import time

import torch

from app.checkpoint_io import read_checkpoint, restore
from app.tools.common import add_config_argument
from heads.ds import DSSoftmax
from heads.ds.build import pruned_head as build_pruned_head
from heads.ds.build import random_kept_mask
from heads.softmax import Softmax


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
    head.load_structure(structure)
    head.load_state_dict(weights)
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
    parser.add_argument("--tiny", action="store_true", help="small sizes for tests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tiny:
        args.in_features, args.num_classes, args.num_experts = 16, 200, 8
        args.samples, args.batches, args.batch_size, args.repeats = 20, 2, 16, 1
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
