"""``python -m app bench lightrnn``: output-layer time and memory of word-level MoS against
Hybrid-LightRNN-MoS, LightRNN-MoS and BPE-MoS at the same number of softmaxes (seed 002,
Table 3) and, with ``--budget``, the most softmaxes each cheaper encoding affords within
word-level MoS's time and memory (seed 002, Tables 4-5).

Variants are ``softmax``, ``mos``, ``lightrnn-mos``, ``hybrid-mos``, ``codes-mos`` and ``bpe-mos``,
each with ``--components`` softmaxes unless written ``name:K``. ``hybrid-mos`` is the output-only
factorisation (``heads.HybridLightRNN``); ``codes-mos`` is the code-sequence model of seed 002
Eq. 4 (``heads.lightrnn.HybridLightRNNCodes``): one MoS over the ``K + d2`` codes, scored at two
decoder states per word, so it sees ``2N`` states. Its network also runs twice the steps, which
this output-layer figure does not include. ``bpe-mos`` is MoS over a subword
vocabulary of ``--bpe-vocab`` pieces; the same text is longer in pieces than in words, so it
sees ``round(N * --bpe-tokens-per-word)`` decoder states where the word-level variants see N
(the default 1.14 is the measured ratio of an 8k sentencepiece BPE on Multi30k's English
training text, docs/hybrid_lightrnn.md).

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
  earlier process states (the imports' transient peak, larger than any head's figure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass

import torch

from app.tools.common import (
    apply_tiny, check_report_files, interleaved_times, peak_growth_bytes, probe_in_subprocess, ratio, reset_peak_rss, rss_bytes, write_reports,
)
from heads import HybridLightRNN
from heads.lightrnn import HybridLightRNNCodes
from heads.base import OutputHead
from heads.registry import create_head, head_factory

VARIANTS = ("softmax", "mos", "lightrnn-mos", "hybrid-mos", "codes-mos", "bpe-mos")
BASELINE = "mos"
BUDGET_FAMILIES = ("hybrid-mos", "bpe-mos")  # the encodings seed 002 spends the saving on


@dataclass
class Sizes:
    tokens: int
    hidden: int
    vocab: int
    components: int
    exclusive: int
    bpe_vocab: int = 10000
    bpe_tokens_per_word: float = 1.14


def parse_variant(spec: str, default_components: int) -> tuple[str, int]:
    """``"hybrid-mos:9"`` -> ``("hybrid-mos", 9)``; a bare name takes ``default_components``."""
    name, _, count = spec.partition(":")
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r} in --heads: valid are {', '.join(VARIANTS)} (optionally name:K)")
    if not count:
        return name, default_components
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"variant {spec!r}: K after ':' must be an integer >= 1 (e.g. {name}:3)")
    return name, int(count)


def variant_tokens(name: str, sizes: Sizes) -> int:
    """Decoder states per batch: BPE spells the same text in more (sub-word) tokens; the code
    model reads and predicts two codes per word."""
    if name == "codes-mos":
        return 2 * sizes.tokens
    return max(1, round(sizes.tokens * sizes.bpe_tokens_per_word)) if name == "bpe-mos" else sizes.tokens


def variant_vocab(name: str, sizes: Sizes) -> int:
    return sizes.bpe_vocab if name == "bpe-mos" else sizes.vocab


def build_head(spec: str, sizes: Sizes) -> OutputHead:
    name, K = parse_variant(spec, sizes.components)
    g, V = sizes.hidden, variant_vocab(name, sizes)

    mos = head_factory("mos", size=K)
    if name == "softmax":
        return create_head("softmax", g, V)
    if name in ("mos", "bpe-mos"):
        return mos(g, V)
    exclusive = 0 if name == "lightrnn-mos" else sizes.exclusive  # else hybrid-mos, codes-mos
    if name == "codes-mos":
        return HybridLightRNNCodes(g, V, num_exclusive=exclusive, inner=mos)
    return create_head("hybrid_lightrnn", g, V, num_exclusive=exclusive, inner=mos)


class Case:
    """One head with a batch of decoder states and Zipf-distributed targets."""

    def __init__(self, spec: str, sizes: Sizes, seed: int = 0) -> None:
        torch.manual_seed(seed)
        name, _ = parse_variant(spec, sizes.components)
        tokens, vocab = variant_tokens(name, sizes), variant_vocab(name, sizes)
        self.name, self.head = spec, build_head(spec, sizes).train()
        words = sizes.tokens if name == "codes-mos" else tokens  # the code model scores each word at two states
        ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
        self.target = torch.multinomial(1.0 / ranks, words, replacement=True)  # (N,) words
        if name == "codes-mos":  # (1, 2N, g) code steps against (1, N) words
            self.hidden = torch.randn(1, tokens, sizes.hidden, requires_grad=True)
            self.target = self.target.unsqueeze(0)
        else:
            self.hidden = torch.randn(tokens, sizes.hidden, requires_grad=True)  # (N, g)

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
    try:
        return probe_in_subprocess("app.bench.lightrnn", ["--memory-probe", name, *size_args(sizes)], threads)
    except RuntimeError as error:
        print(f"memory probe for {name} failed: {error}", file=sys.stderr)
        return None


def size_args(sizes: Sizes) -> list[str]:
    return ["--tokens", str(sizes.tokens), "--hidden", str(sizes.hidden), "--vocab", str(sizes.vocab),
            "--components", str(sizes.components), "--exclusive", str(sizes.exclusive),
            "--bpe-vocab", str(sizes.bpe_vocab), "--bpe-tokens-per-word", repr(sizes.bpe_tokens_per_word)]


def run(variants: list[str], sizes: Sizes, repeats: int, warmup: int, threads: int, memory: bool) -> dict:
    cases = [Case(name, sizes) for name in variants]
    params = {c.name: sum(p.numel() for p in c.head.parameters()) for c in cases}
    codes = {c.name: (f"{c.head.num_exclusive}+{c.head.rows}x{c.head.cols}" if isinstance(c.head, HybridLightRNN)
                      else str(c.head.num_classes)) for c in cases}
    tokens = {c.name: c.hidden.shape[-2] for c in cases}
    times = interleaved_times({c.name: c.step for c in cases}, warmup, repeats)
    del cases
    rows = {}
    for name in variants:
        rows[name] = {
            "seconds": statistics.median(times[name]),
            "parameters": params[name],
            "codes": codes[name],
            "tokens": tokens[name],
            "memory": memory_in_subprocess(name, sizes, threads) if memory else None,
        }
    return {"sizes": vars(sizes), "threads": threads, "repeats": repeats, "rows": rows,
            "budget": within_budget(rows, sizes.components)}


def within_budget(rows: dict, default_components: int) -> dict[str, dict[str, int | None]]:
    """For each cheaper encoding, the largest K whose time (and process memory) stays within the
    word-level MoS baseline's (seed 002 Tables 4-5: what the saving buys)."""
    base = rows.get(BASELINE)
    if base is None:
        return {}
    base_mem = (base.get("memory") or {}).get("process")
    result: dict[str, dict[str, int | None]] = {}
    for family in BUDGET_FAMILIES:
        measured = [(parse_variant(spec, default_components)[1], row) for spec, row in rows.items()
                    if parse_variant(spec, default_components)[0] == family]
        if not measured:
            continue
        fits_time = [k for k, row in measured if row["seconds"] <= base["seconds"]]
        fits_memory = [k for k, row in measured
                       if base_mem and (row.get("memory") or {}).get("process") is not None
                       and row["memory"]["process"] <= base_mem]
        fits_both = sorted(set(fits_time) & set(fits_memory)) if base_mem else []
        result[family] = {"time": max(fits_time, default=None), "memory": max(fits_memory, default=None),
                          "both": max(fits_both, default=None), "tried": sorted(k for k, _ in measured)}
    return result


def format_table(result: dict) -> str:
    s, rows = result["sizes"], result["rows"]
    base = rows.get(BASELINE, {})
    base_mem = base.get("memory") or {}
    lines = [
        f"output layer, forward+backward: N={s['tokens']} tokens, decoder width {s['hidden']}, V={s['vocab']}, "
        f"{s['components']} softmaxes per MoS unless name:K, K={s['exclusive']} exclusive codes (hybrid), "
        f"BPE {s['bpe_vocab']} pieces x{s['bpe_tokens_per_word']:g} tokens; "
        f"threads={result['threads']}; median of {result['repeats']} interleaved repeats",
        "",
        "| head | code dictionary | tokens | parameters | time (ms) | vs MoS | step peak (MiB) | vs MoS "
        "| process peak (MiB) | vs MoS |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        mem = row["memory"] or {}
        step, process = mem.get("step"), mem.get("process")
        lines.append(
            f"| {name} | {row['codes']} | {row['tokens']} | {row['parameters'] / 1e6:.2f}M | {row['seconds'] * 1e3:.1f} "
            f"| {ratio(row['seconds'], base.get('seconds'))} "
            f"| {'-' if step is None else f'{step / 2**20:.0f}'} | {ratio(step, base_mem.get('step'))} "
            f"| {'-' if process is None else f'{process / 2**20:.0f}'} | {ratio(process, base_mem.get('process'))} |"
        )
    budget = result.get("budget") or {}
    if budget:
        lines += ["", f"equal budget: the most softmaxes within word-level MoS-{s['components']}'s time / process memory",
                  "", "| encoding | K tried | max K within time | max K within memory | max K within both |",
                  "|---|---|---:|---:|---:|"]
        for family, fit in budget.items():
            lines.append(f"| {family} | {','.join(map(str, fit['tried']))} | {fit['time'] or '-'} "
                         f"| {fit['memory'] or '-'} | {fit['both'] or '-'} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app bench lightrnn", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="N, decoder states per batch")
    parser.add_argument("--hidden", type=int, default=512, help="decoder width (seed 002 MT: LSTM-512)")
    parser.add_argument("--vocab", type=int, default=30000, help="V, target vocabulary (seed 002 MT: 30k)")
    parser.add_argument("--components", type=int, default=3, help="softmaxes per MoS (MoS-3)")
    parser.add_argument("--exclusive", type=int, default=None,
                        help="K, exclusive codes of Hybrid-LightRNN (default: 30%% of --vocab, the shipped configs' share)")
    parser.add_argument("--bpe-vocab", type=int, default=10000, help="pieces of the BPE vocabulary (bpe-mos)")
    parser.add_argument("--bpe-tokens-per-word", type=float, default=1.14,
                        help="BPE pieces per word of the same text (bpe-mos sees N times this many states)")
    parser.add_argument("--heads", default=",".join(VARIANTS), help="comma-separated variants, each name or name:K")
    parser.add_argument("--budget", default=None,
                        help="comma-separated K: also time hybrid-mos:K and bpe-mos:K for each, and report the "
                             "largest K within word-level MoS's time and memory (seed 002 Tables 4-5)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes per variant first")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant memory subprocesses")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes for a quick check (tests); options given explicitly win")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_report_files(args)  # before anything is measured
    if args.tiny:  # options given explicitly win
        apply_tiny(parser, argv, args, dict(tokens=32, hidden=16, vocab=300, exclusive=20, repeats=2, bpe_vocab=120))
    for key in ("tokens", "hidden", "vocab", "components", "repeats", "threads", "bpe_vocab"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.exclusive is None:
        args.exclusive = round(0.3 * args.vocab)  # configs/heads/hybrid_lightrnn_mos.yaml: exclusive_fraction 0.3
    if args.warmup < 0 or args.exclusive < 0:
        parser.error(f"--warmup and --exclusive must be >= 0, got {args.warmup} and {args.exclusive}")
    if not args.bpe_tokens_per_word > 0:
        parser.error(f"--bpe-tokens-per-word must be > 0 (pieces per word of the same text), got {args.bpe_tokens_per_word}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(args.threads)
    sizes = Sizes(args.tokens, args.hidden, args.vocab, args.components, args.exclusive, args.bpe_vocab,
                  args.bpe_tokens_per_word)
    if args.memory_probe is not None:
        print(json.dumps(probe_memory(args.memory_probe, sizes)))
        return 0
    variants = [v.strip() for v in args.heads.split(",") if v.strip()]
    if not variants:
        print(f"error: --heads is empty: name one or more of {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    try:
        if args.budget:
            if BASELINE not in variants:
                variants.insert(0, BASELINE)
            for k in args.budget.split(","):
                for family in BUDGET_FAMILIES:
                    count = parse_variant(f"{family}:{k.strip()}", args.components)[1]
                    spec = family if count == args.components else f"{family}:{count}"
                    if spec not in variants:
                        variants.append(spec)
        for name in variants:  # validate names and sizes (e.g. K > V) before timing anything
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
