"""``python -m app bench train``: training speed and memory of output heads, the papers' Tables 3-6
at CPU scale, every ratio measured in one run.

For a preset (the seeds' model dimensions; batch sizes reduced to fit a CPU) and a list of heads:

* **Same batch size.** Time of one step of the *output layer alone* (forward + backward +
  SGD step of the head, on random hidden states) and of the *whole network* (encoder + head,
  forward + backward + optimizer step), all heads' models alive at once and timed
  interleaved repeat by repeat (warm-up repeats dropped) so they share the machine's load;
  medians with min-max spread.
* **Peak memory** of a whole-network step: parameters and optimizer state (counted) plus the
  step's own peak (gradients, activations, saved tensors): the resident-set high-water mark
  of one step minus the RSS before it, with glibc's mmap threshold pinned low so freed
  buffers leave the process at once (see :mod:`app.tools.common`). Measured one head at a
  time, after a warm-up step.
* **Same memory budget** (``--budget``): memory is affine in the batch size, so it is probed
  at two batch sizes, the largest batch under the budget is solved for and checked by a third
  probe (shrunk until it fits), then one step at that batch is timed (one head after another:
  each needs the whole budget) and reported per instance (sequence or sentence).
* **FLOPs** of one step, counted by torch's FLOP counter (matmuls, attention), plus the LSTM
  layers' gate matmuls counted analytically (the fused RNN kernel is invisible to the counter),
  and the achieved FLOP/s against the machine's fp32 matmul peak, measured as a square
  ``torch.mm`` timed in the same interleaved rounds (so under the same load as the heads).

Heads: the registry's trainable ``bottleneck``, ``clustered`` and ``sparse`` heads
(:func:`app.bench.workloads.train_heads`), ``name[:K]``: ``softmax`` (with the latent projection
``tanh(P g)`` when the encoder output ``g`` is wider than the embedding ``d``), ``moc[:K]``,
``adaptive_softmax``, ``mos[:K]``, ``mixtape[:K]``, ``sigsoftmax``, ``ds_softmax[:K]``. DS-Softmax is timed in its pruned state: each class kept by ``--ds-redundancy``
experts on average (the structure after group-lasso pruning; a dense ``K x V`` DS head is
never what trains for long).
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import sys
from dataclasses import asdict
from typing import Callable

import torch

from app.bench.workloads import (
    PRESETS, Preset, Workload, check_redundancy, default_specs, is_sparse_experts, isolated_peak_bytes, largest_batch,
    make_head, parse_head, train_heads, whole_peak_bytes,
)
from app.tools.common import (
    apply_tiny, check_report_files, count_flops, interleaved_times, mallopt_available, matmul_peak, summarize, write_reports,
)



COLUMNS = [
    "head", "output_ms", "output_min_ms", "output_max_ms", "output_vs_softmax", "whole_ms", "whole_min_ms",
    "whole_max_ms", "whole_vs_softmax", "output_share", "peak_mib", "peak_vs_softmax", "output_gflop",
    "output_gflops", "output_pct_peak", "whole_gflop", "whole_gflops", "whole_pct_peak",
    "budget_batch", "budget_step_ms", "budget_ms_per_instance", "budget_vs_softmax",
]


# ---------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> dict:
    preset: Preset = args.preset_sizes
    peak = matmul_peak(args.peak_size)
    budget = int(args.budget * 2**30)
    rows: list[dict] = [{"head": spec, **{key: None for key in COLUMNS[1:]}} for spec in args.heads]
    if not args.no_same_batch:
        # Same batch size: every head's model alive, timed interleaved.
        works = {spec: Workload(spec, preset, preset.batch, args.ds_redundancy) for spec in args.heads}
        flops = {spec: (count_flops(w.output_step), w.whole_flops()) for spec, w in works.items()}
        # The physical limit is measured inside the same interleaved rounds, under the same load.
        a, b = torch.randn(args.peak_size, args.peak_size), torch.randn(args.peak_size, args.peak_size)
        steps: dict[tuple[str, str], Callable[[], None]] = {("peak", "matmul"): lambda: torch.mm(a, b)}
        for spec, w in works.items():
            steps[(spec, "output")] = w.output_step
            steps[(spec, "whole")] = w.whole_step
        times = interleaved_times(steps, args.warmup, args.repeats)
        del works, steps
        peak = 2 * args.peak_size**3 / summarize(times[("peak", "matmul")])["median"]
        for row in rows:
            spec = row["head"]
            out, whole = summarize(times[(spec, "output")]), summarize(times[(spec, "whole")])
            row.update({
                "output_ms": out["median"] * 1e3, "output_min_ms": out["min"] * 1e3,
                "output_max_ms": out["max"] * 1e3, "whole_ms": whole["median"] * 1e3,
                "whole_min_ms": whole["min"] * 1e3, "whole_max_ms": whole["max"] * 1e3,
                "output_gflop": flops[spec][0] / 1e9, "whole_gflop": flops[spec][1] / 1e9,
            })
    # Memory, one head at a time, with every allocation its own mapping (timings above ran
    # with the allocator as training has it); then the same-memory-budget batch and its timing.
    memory_ok = mallopt_available()
    probe = whole_peak_bytes if args.in_process_memory else functools.partial(isolated_peak_bytes, threads=args.threads)
    for row in rows:
        spec = row["head"]
        if not args.no_same_batch:
            row["peak_mib"] = probe(spec, preset, preset.batch, args.ds_redundancy) / 2**20
        if args.no_budget:
            continue
        batch, _ = largest_batch(spec, preset, budget, args.ds_redundancy, args.max_batch, probe=probe)
        row["budget_batch"] = batch
        if batch == 0:
            continue
        work = Workload(spec, preset, batch, args.ds_redundancy, output=False)
        step = summarize(interleaved_times({spec: work.whole_step}, 1, args.budget_repeats)[spec])
        del work
        row["budget_step_ms"] = step["median"] * 1e3
        row["budget_ms_per_instance"] = step["median"] * 1e3 / batch
    base = next((r for r in rows if parse_head(r["head"])[0] == "softmax"), rows[0])

    def ratio(row: dict, key: str) -> float | None:
        return None if row.get(key) is None or not base.get(key) else row[key] / base[key]

    for row in rows:  # every ratio from the measured values of this run
        row["output_vs_softmax"] = ratio(row, "output_ms")
        row["whole_vs_softmax"] = ratio(row, "whole_ms")
        row["peak_vs_softmax"] = ratio(row, "peak_mib")
        row["budget_vs_softmax"] = ratio(row, "budget_ms_per_instance")
        if row["output_ms"] is not None:
            row["output_share"] = row["output_ms"] / row["whole_ms"]
            row["output_gflops"] = row["output_gflop"] / (row["output_ms"] / 1e3)
            row["whole_gflops"] = row["whole_gflop"] / (row["whole_ms"] / 1e3)
            row["output_pct_peak"] = 100 * row["output_gflops"] * 1e9 / peak
            row["whole_pct_peak"] = 100 * row["whole_gflops"] * 1e9 / peak
    return {
        "preset": args.preset, "sizes": asdict(preset), "threads": args.threads, "repeats": args.repeats,
        "warmup": args.warmup, "budget_gib": args.budget, "budget_repeats": args.budget_repeats,
        "ds_redundancy": args.ds_redundancy, "matmul_peak_gflops": peak / 1e9, "peak_size": args.peak_size,
        "peak_interleaved": not args.no_same_batch, "mmap_threshold_pinned": memory_ok,
        "rows": rows,
    }


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_markdown(result: dict) -> str:
    s = result["sizes"]
    unit = "sequences" if s["model"] == "lstm" else "sentence pairs"
    lines = [
        f"preset {result['preset']}: {s['model']}, V={s['vocab']}, d={s['embedding']}, hidden={s['hidden']}, "
        f"layers={s['layers']}, g={s['last_hidden']}; batch {s['batch']} {unit} x {s['length']} tokens "
        f"(paper: {s['paper_batch']}); threads={result['threads']}; median of {result['repeats']} interleaved "
        f"repeats ({result['warmup']} warm-up dropped), min-max in brackets",
        f"measured fp32 matmul peak: {result['matmul_peak_gflops']:.1f} GFLOP/s (median {result['peak_size']}^2 "
        f"torch.mm{', timed in the same interleaved rounds as the heads' if result['peak_interleaved'] else ''})",
    ]
    same_batch = [
        "",
        "Same batch size (output layer alone: forward+backward+SGD step of the head; whole network: "
        "encoder+head forward+backward+optimizer step):",
        "",
        "| head | output layer ms | vs softmax | whole network ms | vs softmax | output share | peak MiB | vs softmax "
        "| output GFLOP | output GFLOP/s | % of peak | whole GFLOP | whole GFLOP/s | % of peak |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if any(r["output_ms"] is not None for r in result["rows"]):
        lines += same_batch
    for r in result["rows"]:
        if r["output_ms"] is None:
            continue
        lines.append(
            f"| {r['head']} | {r['output_ms']:.1f} ({r['output_min_ms']:.1f}-{r['output_max_ms']:.1f}) "
            f"| {_x(r['output_vs_softmax'])} | {r['whole_ms']:.1f} ({r['whole_min_ms']:.1f}-{r['whole_max_ms']:.1f}) "
            f"| {_x(r['whole_vs_softmax'])} | {100 * r['output_share']:.0f}% | {_f(r['peak_mib'], 0 if r['peak_mib'] >= 10 else 2)} "
            f"| {_x(r['peak_vs_softmax'])} | {r['output_gflop']:.2f} | {r['output_gflops']:.1f} "
            f"| {r['output_pct_peak']:.0f}% | {r['whole_gflop']:.2f} | {r['whole_gflops']:.1f} | {r['whole_pct_peak']:.0f}% |"
        )
    if any(r["budget_batch"] is not None for r in result["rows"]):
        lines += [
            "",
            f"Same memory budget ({result['budget_gib']:g} GiB for the whole-network step; median of "
            f"{result['budget_repeats']} steps after 1 warm-up, heads timed one after another):",
            "",
            f"| head | largest batch ({unit}) | step ms | ms per instance | vs softmax |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in result["rows"]:
            lines.append(
                f"| {r['head']} | {_f(r['budget_batch'], 0) if r['budget_batch'] else 'does not fit'} "
                f"| {_f(r['budget_step_ms'])} | {_f(r['budget_ms_per_instance'], 2)} | {_x(r['budget_vs_softmax'])} |"
            )
    return "\n".join(lines)


def format_csv(result: dict) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["preset", *COLUMNS])
    writer.writeheader()
    for row in result["rows"]:
        writer.writerow({"preset": result["preset"], **{key: row.get(key) for key in COLUMNS}})
    return out.getvalue()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app bench train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="ptb", help="model dimensions and batch (see PRESETS)")
    parser.add_argument("--heads", default=",".join(default_specs()),
                        help=f"comma-separated heads, name[:K] ({', '.join(train_heads())})")
    parser.add_argument("--batch", type=int, default=None, help="batch for the same-batch table (overrides the preset)")
    parser.add_argument("--length", type=int, default=None, help="BPTT window / target length (overrides the preset)")
    parser.add_argument("--budget", type=float, default=2.0, help="memory budget in GiB for the same-budget table")
    parser.add_argument("--max-batch", type=int, default=256, help="largest batch the budget search may pick")
    parser.add_argument("--no-budget", action="store_true", help="skip the same-memory-budget table")
    parser.add_argument("--no-same-batch", action="store_true", help="skip the same-batch-size table")
    parser.add_argument("--ds-redundancy", type=float, default=1.5, help="mean experts keeping a class (pruned DS)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per head and mode (median reported)")
    parser.add_argument("--budget-repeats", type=int, default=3, help="timed steps at the budget batch")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per head and mode first")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--peak-size", type=int, default=1536, help="side of the square matmul measuring the peak")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes for a quick check (tests); --batch, --length, --repeats, ... given explicitly win")
    parser.add_argument("--csv", default=None, help="also write the table as CSV to this file")
    parser.add_argument("--json", default=None, help="also write the full results as JSON to this file")
    parser.add_argument("--in-process-memory", action="store_true",
                        help="probe memory in this process (faster, less exact; default: a fresh process per probe)")
    parser.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-batch", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-preset", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_report_files(args)  # before anything is measured
    if args.memory_probe is not None:  # child of isolated_peak_bytes
        args.preset_sizes = Preset(**json.loads(args.probe_preset))
        return args
    preset = PRESETS[args.preset]
    if args.tiny:
        preset = Preset(preset.model, 300, 16, 24, 2, 24, 2, 6, preset.paper_batch)
        apply_tiny(parser, argv, args, dict(repeats=2, budget_repeats=1, max_batch=8, peak_size=256, budget=min(args.budget, 0.25)))
        args.in_process_memory = True  # seconds, not a subprocess per probe
    preset = Preset(**{**asdict(preset), "batch": args.batch or preset.batch, "length": args.length or preset.length})
    args.preset_sizes = preset
    for key in ("repeats", "budget_repeats", "threads", "max_batch", "peak_size"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if preset.batch < 1 or preset.length < 1:
        parser.error(f"--batch and --length must be >= 1, got {preset.batch} and {preset.length}")
    if args.warmup < 0 or not args.budget > 0:
        parser.error(f"--warmup must be >= 0 and --budget > 0, got {args.warmup} and {args.budget}")
    if args.no_budget and args.no_same_batch:
        parser.error("--no-budget and --no-same-batch leave nothing to measure: drop one of them")
    args.heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    if not args.heads:
        parser.error("--heads is empty: give e.g. softmax,mixtape")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(args.threads)
    if args.memory_probe is not None:
        print(json.dumps({"peak_bytes": whole_peak_bytes(args.memory_probe, args.preset_sizes, args.probe_batch, args.ds_redundancy)}))
        return 0
    try:
        for spec in args.heads:  # validate names and sizes (e.g. Mixtape's gates) before timing anything
            name, K = parse_head(spec)
            if is_sparse_experts(name):
                check_redundancy(args.ds_redundancy, K)
            else:
                make_head(spec, 8, 16, 8)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = run(args)
    print(format_markdown(result))
    write_reports(result, args.json, args.csv, format_csv(result) if args.csv else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
