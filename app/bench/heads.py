"""``python -m app bench heads``: forward+backward time, evaluation and compiled time, peak memory and FLOP/s of output heads.

All variants are timed in ONE process, interleaved repeat by repeat (warm-up excluded, median
reported), so the ratios to softmax and to the plain reference implementations are measured
under the same machine load. Each variant is timed two ways in the same rounds, three with
``--compile``:

* training: one forward+backward of the per-token NLL (mean), eager;
* evaluation: the same forward in eval mode under ``torch.no_grad`` (what validation and test
  run), reported beside its ratio to the training step;
* compiled: the training step through ``torch.compile`` (inductor on the CPU), reported beside
  its ratio to eager. Compilation happens before the timed rounds; its wall time is in the JSON
  (``compile_seconds``). Only with ``--compile``: inductor compiling every head is slow on a CPU.

The heads are the registry's compared families (softmax, adaptive softmax and the heads that break
the bottleneck: :data:`heads.registry.COMPARED_FAMILIES`, :func:`heads.registry.list_heads`), each
followed by its reference variant where :data:`REFERENCE_NLL` has one: the straightforward
transcriptions in :mod:`heads.reference` (probability-space MoS with ``log(p + 1e-8)`` as in the
public MoS code; Mixtape with dense per-token gates).

Peak memory (CPU). ``tracemalloc`` does not see torch's allocations, so each variant is run
once more in a fresh subprocess with glibc's mmap threshold pinned low
(``MALLOC_MMAP_THRESHOLD_``), so every tensor-sized buffer is its own mapping that returns to the
OS when freed. After a warm-up step the kernel's high-water mark is reset
(``/proc/self/clear_refs``, value 5) and the reported figure is
``VmHWM after one forward+backward - VmRSS before it``: the memory the step itself added
(activations, saved tensors, gradients), excluding the parameters and the input.

FLOPs are counted, not estimated: :class:`torch.utils.flop_counter.FlopCounterMode` records
every matmul executed in one forward+backward (including a custom backward's recomputation).
The machine's fp32 matmul peak is the median time of a square ``torch.mm``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from app.tools.common import apply_tiny, check_report_files
from app.tools.common import count_flops as count_step_flops
from app.tools.common import (
    interleaved_times, peak_growth_bytes, probe_in_subprocess, ratio, reset_peak_rss, rss_bytes, write_reports,
)
from heads.base import OutputHead
from heads.reference import mixtape_log_prob, mos_log_prob, nll_from_log_prob
from heads.registry import COMPARED_FAMILIES, check_heads, create_head, head_class, list_heads, size_argument

#: The reference variants' NLL: the plain transcriptions of heads/reference.py (MoS as the public
#: AWD-LSTM-MoS code computes it, with ``eps = 1e-8``).
REFERENCE_NLL = {
    "mos": lambda h, x, t: nll_from_log_prob(mos_log_prob(h, x, eps=1e-8), t),
    "mixtape": lambda h, x, t: nll_from_log_prob(mixtape_log_prob(h, x), t),
}
#: Bench options passed to every head whose constructor takes them (Mixtape's d2 and r).
HEAD_OPTIONS = ("gate_dim", "frequent_fraction")


def all_variants() -> list[str]:
    """Every head of the registry's :data:`~heads.registry.COMPARED_FAMILIES`, each followed by its ``-reference``
    variant where :data:`REFERENCE_NLL` has one."""
    variants = []
    for name in list_heads(COMPARED_FAMILIES):
        variants += [name, f"{name}-reference"] if name in REFERENCE_NLL else [name]
    return variants


def reference_of(name: str) -> str | None:
    """The reference variant a variant is compared with."""
    return f"{name}-reference" if name in REFERENCE_NLL else None


@dataclass
class Sizes:
    tokens: int
    hidden: int
    dim: int
    vocab: int
    components: int
    gates: int
    gate_dim: int
    frequent_fraction: float


def build_variant(name: str, sizes: Sizes) -> tuple[OutputHead, Callable[[OutputHead, Tensor, Tensor], Tensor]]:
    """The head for a variant and how to compute its per-token NLL (fast path or reference)."""
    check_heads([name], all_variants(), "--heads")
    head_name = name.removesuffix("-reference")
    size = {"num_components": sizes.components, "num_gates": sizes.gates}.get(size_argument(head_name))
    accepted = inspect.signature(head_class(head_name)).parameters
    extra = {key: getattr(sizes, key) for key in HEAD_OPTIONS if key in accepted}
    head = create_head(head_name, sizes.hidden, sizes.vocab, size=size, embedding_dim=sizes.dim, **extra)
    return head, REFERENCE_NLL[head_name] if name.endswith("-reference") else _forward


def _forward(head: OutputHead, hidden: Tensor, target: Tensor) -> Tensor:
    return head(hidden, target)


class Case:
    """One variant with its parameters and inputs, ready to run forward+backward."""

    def __init__(self, name: str, sizes: Sizes, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.name = name
        self.head, self.nll = build_variant(name, sizes)
        self.head.train()
        self.hidden = torch.randn(sizes.tokens, sizes.hidden, requires_grad=True)  # (N, g)
        # Zipf-like targets so frequent ids (Mixtape's own-gate tokens) are frequent.
        ranks = torch.arange(1, sizes.vocab + 1, dtype=torch.float64)
        self.target = torch.multinomial(1.0 / ranks, sizes.tokens, replacement=True)  # (N,)

    def step(self) -> None:
        self._train_step(self.nll)

    def _train_step(self, nll: Callable[[OutputHead, Tensor, Tensor], Tensor]) -> None:
        for p in self.head.parameters():
            p.grad = None
        self.hidden.grad = None
        nll(self.head, self.hidden, self.target).mean().backward()

    def evaluate(self) -> None:
        """The forward of evaluation: eval mode (no dropout), no autograd."""
        self.head.eval()
        with torch.no_grad():
            self.nll(self.head, self.hidden.detach(), self.target)
        self.head.train()

    def compile(self) -> float:
        """Compile the training step's NLL (same parameters); returns the seconds the first,
        compiling, forward+backward took."""
        self._compiled_nll = torch.compile(self.nll, dynamic=False)
        start = time.perf_counter()
        self.compiled_step()
        return time.perf_counter() - start

    def compiled_step(self) -> None:
        self._train_step(self._compiled_nll)


def count_flops(case: Case) -> int:
    """Matmul FLOPs of one forward+backward of ``case``."""
    return count_step_flops(case.step)


def probe_memory(name: str, sizes: Sizes) -> int:
    """Bytes one forward+backward adds on top of parameters and inputs (run in a fresh process)."""
    case = Case(name, sizes)
    case.step()  # warm-up: one-time allocations (thread pools, kernels' scratch) happen here
    for p in case.head.parameters():
        p.grad = None
    case.hidden.grad = None
    reset_peak_rss()
    before = rss_bytes()
    case.step()
    return peak_growth_bytes(before)


def measure_memory_in_subprocess(name: str, sizes: Sizes, threads: int) -> int | None:
    try:
        return int(probe_in_subprocess("app.bench.heads", ["--memory-probe", name, *size_args(sizes)], threads)["peak_bytes"])
    except RuntimeError as error:
        print(f"memory probe for {name} failed: {error}", file=sys.stderr)
        return None


def size_args(sizes: Sizes) -> list[str]:
    return [
        "--tokens", str(sizes.tokens), "--hidden", str(sizes.hidden), "--dim", str(sizes.dim),
        "--vocab", str(sizes.vocab), "--components", str(sizes.components), "--gates", str(sizes.gates),
        "--gate-dim", str(sizes.gate_dim), "--frequent-fraction", str(sizes.frequent_fraction),
    ]


def run(
    variants: list[str], sizes: Sizes, repeats: int, warmup: int, threads: int, memory: bool, peak_size: int = 2048,
    compiled: bool = False,
) -> dict:
    """Time (interleaved, one process: training, evaluation and, with ``compiled``, compiled
    training steps), count FLOPs, and optionally probe memory of each variant."""
    cases = [Case(name, sizes) for name in variants]
    flops = {case.name: count_flops(case) for case in cases}
    compile_seconds = {case.name: case.compile() for case in cases} if compiled else {}
    # The physical limit is timed inside the same interleaved rounds, under the same load.
    a, b = torch.randn(peak_size, peak_size), torch.randn(peak_size, peak_size)
    steps: dict[str, Callable[[], object]] = {"__peak__": lambda: torch.mm(a, b)}
    for case in cases:
        steps[case.name] = case.step
        steps[f"{case.name} eval"] = case.evaluate
        if compiled:
            steps[f"{case.name} compiled"] = case.compiled_step
    times = interleaved_times(steps, warmup, repeats)
    peak = 2 * peak_size**3 / statistics.median(times.pop("__peak__"))
    del cases, steps
    rows = {}
    for name in variants:
        seconds = statistics.median(times[name])
        rows[name] = {
            "seconds": seconds,
            "eval_seconds": statistics.median(times[f"{name} eval"]),
            "compiled_seconds": statistics.median(times[f"{name} compiled"]) if compiled else None,
            "compile_seconds": compile_seconds.get(name),
            "flops": flops[name],
            "flops_per_second": flops[name] / seconds,
            "peak_bytes": measure_memory_in_subprocess(name, sizes, threads) if memory else None,
        }
    return {"sizes": vars(sizes), "matmul_peak_flops": peak, "matmul_peak_size": peak_size, "threads": threads, "repeats": repeats, "rows": rows}


def format_table(result: dict) -> str:
    rows, peak = result["rows"], result["matmul_peak_flops"]
    s = result["sizes"]
    base = rows.get("softmax", {})
    lines = [
        f"sizes: N={s['tokens']} tokens, g={s['hidden']}, d={s['dim']}, V={s['vocab']}, K(MoS/MoC)={s['components']}, "
        f"K(Mixtape)={s['gates']}, d2={s['gate_dim']}, r={s['frequent_fraction']}; threads={result['threads']}; "
        f"median of {result['repeats']} forward+backward passes (eval: forward in eval mode under no_grad; "
        f"compiled: forward+backward through torch.compile)",
        f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s "
        f"(median {result['matmul_peak_size']}^3 torch.mm, timed in the same interleaved rounds)",
        "",
        "| head | time (ms) | vs softmax | vs reference | eval (ms) | eval / fwd+bwd | compiled (ms) "
        "| compiled / eager | peak mem (MiB) | vs softmax | vs reference | GFLOP | GFLOP/s | % of matmul peak |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        ref = rows.get(reference_of(name) or "", {})
        mem, compiled = row["peak_bytes"], row["compiled_seconds"]
        lines.append(
            f"| {name} | {row['seconds'] * 1e3:.1f} | {ratio(row['seconds'], base.get('seconds'))} "
            f"| {ratio(row['seconds'], ref.get('seconds'))} | {row['eval_seconds'] * 1e3:.1f} "
            f"| {ratio(row['eval_seconds'], row['seconds'])} | {'-' if compiled is None else f'{compiled * 1e3:.1f}'} "
            f"| {ratio(compiled, row['seconds'])} "
            f"| {'-' if mem is None else f'{mem / 2**20:.0f}'} | {ratio(mem, base.get('peak_bytes'))} "
            f"| {ratio(mem, ref.get('peak_bytes'))} | {row['flops'] / 1e9:.1f} "
            f"| {row['flops_per_second'] / 1e9:.1f} | {100 * row['flops_per_second'] / peak:.0f}% |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app bench heads", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=840, help="N, tokens per batch (MoS PTB: 12 x 70)")
    parser.add_argument("--hidden", type=int, default=620, help="g, width of the encoder output")
    parser.add_argument("--dim", type=int, default=280, help="d, width of the context vectors / embeddings")
    parser.add_argument("--vocab", type=int, default=10000, help="V, number of classes")
    parser.add_argument("--components", type=int, default=15, help="K of MoS and MoC")
    parser.add_argument("--gates", type=int, default=4, help="K of Mixtape")
    parser.add_argument("--gate-dim", type=int, default=64, help="d2 of Mixtape")
    parser.add_argument("--frequent-fraction", type=float, default=0.1, help="r of Mixtape")
    parser.add_argument("--heads", default=None, help=f"comma-separated variants to run (default: {','.join(all_variants())})")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes per variant first")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant memory subprocesses")
    parser.add_argument("--compile", action="store_true", help="also time the training step through torch.compile (compiles every head first)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes for a quick check (tests); options given explicitly win")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_report_files(args)  # before anything is measured
    if args.tiny:  # options given explicitly win
        apply_tiny(parser, argv, args, dict(tokens=24, hidden=16, dim=8, vocab=60, components=3, gate_dim=4, repeats=2, warmup=1))
    for key in ("tokens", "hidden", "dim", "vocab", "components", "gate_dim", "repeats", "threads"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(args.threads)
    sizes = Sizes(
        args.tokens, args.hidden, args.dim, args.vocab, args.components, args.gates, args.gate_dim,
        args.frequent_fraction,
    )
    if args.memory_probe is not None:
        print(json.dumps({"peak_bytes": probe_memory(args.memory_probe, sizes)}))
        return 0
    variants = all_variants() if args.heads is None else [v.strip() for v in args.heads.split(",") if v.strip()]
    try:
        check_heads(variants, all_variants(), "--heads")
        for name in variants:  # validate sizes (e.g. Mixtape's gates) before timing anything
            build_variant(name, sizes)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = run(
        variants, sizes, args.repeats, args.warmup, args.threads, memory=not args.no_memory,
        peak_size=512 if args.tiny else 2048, compiled=args.compile,
    )
    print(format_table(result))
    write_reports(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
