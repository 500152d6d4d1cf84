"""``python -m app bench lightrnn``: output-layer time and memory of word-level MoS against
Hybrid-LightRNN-MoS and LightRNN-MoS at the same number of softmaxes (seed 002, Table 3).

The output layer alone is measured (the LSTM-512 decoder's states are the input): one
forward+backward of the per-token NLL, all variants in ONE process, interleaved repeat by
repeat (warm-up excluded, median reported), so the time ratios share the machine's load.

Peak memory (CPU), each variant in a fresh subprocess (no allocator state shared):
* ``step``: what one forward+backward adds on top of the parameters and the input, i.e. the
  resident-set high-water mark after the step minus the resident set before it, with glibc's
  mmap threshold pinned low so freed tensors leave the process at once (as in
  ``bench heads``);
* ``process``: the resident-set high-water mark after building the head and running one
  step, minus the resident set right after the imports: parameters, their gradients and the
  step together, the figure a training run pays for its output layer. The high-water mark
  is reset after the imports (``/proc/self/clear_refs``) and read from ``VmHWM``: this is the
  counter ``getrusage().ru_maxrss`` reports, but ``ru_maxrss`` also keeps the maximum of
  earlier process states (the imports' transient peak, about 1 GiB here), which hid every
  head's figure in a first version of this probe.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

import torch

from app.benchmarking import interleaved_times, peak_growth_bytes, reset_peak_rss, rss_bytes, write_reports
from heads import HybridLightRNN, MixtureOfSoftmaxes, Softmax
from heads.base import OutputHead

VARIANTS = ("softmax", "mos", "lightrnn-mos", "hybrid-mos")
BASELINE = "mos"


@dataclass
class Sizes:
    tokens: int
    hidden: int
    vocab: int
    components: int
    exclusive: int


def build_head(name: str, sizes: Sizes) -> OutputHead:
    g, V, K = sizes.hidden, sizes.vocab, sizes.components

    def mos(i: int, n: int) -> OutputHead:
        return MixtureOfSoftmaxes(i, n, num_components=K)

    if name == "softmax":
        return Softmax(g, V)
    if name == "mos":
        return mos(g, V)
    if name == "lightrnn-mos":
        return HybridLightRNN(g, V, num_exclusive=0, inner=mos)
    if name == "hybrid-mos":
        return HybridLightRNN(g, V, num_exclusive=sizes.exclusive, inner=mos)
    raise ValueError(f"unknown variant {name!r}: valid are {', '.join(VARIANTS)}")


class Case:
    """One head with a batch of decoder states and Zipf-distributed targets."""

    def __init__(self, name: str, sizes: Sizes, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.name, self.head = name, build_head(name, sizes).train()
        self.hidden = torch.randn(sizes.tokens, sizes.hidden, requires_grad=True)  # (N, g)
        ranks = torch.arange(1, sizes.vocab + 1, dtype=torch.float64)
        self.target = torch.multinomial(1.0 / ranks, sizes.tokens, replacement=True)  # (N,)

    def step(self) -> None:
        for p in self.head.parameters():
            p.grad = None
        self.hidden.grad = None
        self.head(self.hidden, self.target).mean().backward()


def probe_memory(name: str, sizes: Sizes) -> dict[str, int]:
    """Run in a fresh process: ``step`` and ``process`` peak bytes (see the module docstring)."""
    reset_peak_rss()  # forget the imports' transient peak: VmHWM restarts from the current RSS
    baseline = rss_bytes()
    case = Case(name, sizes)
    case.step()  # warm-up; also allocates the parameter gradients a training run keeps
    process = peak_growth_bytes(baseline)
    for p in case.head.parameters():
        p.grad = None
    case.hidden.grad = None
    reset_peak_rss()
    before = rss_bytes()
    case.step()
    return {"step": peak_growth_bytes(before), "process": process}


def memory_in_subprocess(name: str, sizes: Sizes, threads: int) -> dict[str, int] | None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "app.bench_lightrnn", "--memory-probe", name, *size_args(sizes), "--threads", str(threads)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        print(f"memory probe for {name} failed: {result.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def size_args(sizes: Sizes) -> list[str]:
    return ["--tokens", str(sizes.tokens), "--hidden", str(sizes.hidden), "--vocab", str(sizes.vocab),
            "--components", str(sizes.components), "--exclusive", str(sizes.exclusive)]


def run(variants: list[str], sizes: Sizes, repeats: int, warmup: int, threads: int, memory: bool) -> dict:
    cases = [Case(name, sizes) for name in variants]
    params = {c.name: sum(p.numel() for p in c.head.parameters()) for c in cases}
    codes = {c.name: (f"{c.head.num_exclusive}+{c.head.rows}x{c.head.cols}" if isinstance(c.head, HybridLightRNN)
                      else str(sizes.vocab)) for c in cases}
    times = interleaved_times({c.name: c.step for c in cases}, warmup, repeats)
    del cases
    rows = {}
    for name in variants:
        rows[name] = {
            "seconds": statistics.median(times[name]),
            "parameters": params[name],
            "codes": codes[name],
            "memory": memory_in_subprocess(name, sizes, threads) if memory else None,
        }
    return {"sizes": vars(sizes), "threads": threads, "repeats": repeats, "rows": rows}


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def format_table(result: dict) -> str:
    s, rows = result["sizes"], result["rows"]
    base = rows.get(BASELINE, {})
    base_mem = base.get("memory") or {}
    lines = [
        f"output layer, forward+backward: N={s['tokens']} tokens, decoder width {s['hidden']}, V={s['vocab']}, "
        f"{s['components']} softmaxes per MoS, K={s['exclusive']} exclusive codes (hybrid); "
        f"threads={result['threads']}; median of {result['repeats']} interleaved repeats",
        "",
        "| head | code dictionary | parameters | time (ms) | vs MoS | step peak (MiB) | vs MoS "
        "| process peak (MiB) | vs MoS |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        mem = row["memory"] or {}
        step, process = mem.get("step"), mem.get("process")
        lines.append(
            f"| {name} | {row['codes']} | {row['parameters'] / 1e6:.2f}M | {row['seconds'] * 1e3:.1f} "
            f"| {_ratio(row['seconds'], base.get('seconds'))} "
            f"| {'-' if step is None else f'{step / 2**20:.0f}'} | {_ratio(step, base_mem.get('step'))} "
            f"| {'-' if process is None else f'{process / 2**20:.0f}'} | {_ratio(process, base_mem.get('process'))} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app bench lightrnn", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="N, decoder states per batch")
    parser.add_argument("--hidden", type=int, default=512, help="decoder width (seed 002 MT: LSTM-512)")
    parser.add_argument("--vocab", type=int, default=30000, help="V, target vocabulary (seed 002 MT: 30k)")
    parser.add_argument("--components", type=int, default=3, help="softmaxes per MoS (MoS-3)")
    parser.add_argument("--exclusive", type=int, default=1000, help="K, exclusive codes of Hybrid-LightRNN")
    parser.add_argument("--heads", default=",".join(VARIANTS), help="comma-separated variants")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes per variant first")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant memory subprocesses")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes for a quick check (tests)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.tokens, args.hidden, args.vocab, args.exclusive, args.repeats = 32, 16, 300, 20, 2
    for key in ("tokens", "hidden", "vocab", "components", "repeats", "threads"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0 or args.exclusive < 0:
        parser.error(f"--warmup and --exclusive must be >= 0, got {args.warmup} and {args.exclusive}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(args.threads)
    sizes = Sizes(args.tokens, args.hidden, args.vocab, args.components, args.exclusive)
    if args.memory_probe is not None:
        print(json.dumps(probe_memory(args.memory_probe, sizes)))
        return 0
    variants = [v.strip() for v in args.heads.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        print(f"error: unknown --heads {', '.join(unknown) or '(none)'}: valid are {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    try:
        for name in variants:  # validate sizes (e.g. K > V) before timing anything
            build_head(name, sizes)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = run(variants, sizes, args.repeats, args.warmup, args.threads, memory=not args.no_memory)
    print(format_table(result))
    write_reports(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
