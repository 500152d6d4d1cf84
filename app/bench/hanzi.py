"""``python -m app bench hanzi``: training throughput of character-recognition encoders.

Each variant is a :class:`tasks.encoders.HanziCNN` with an output head over the 3,755 GB2312 level-1
classes, trained on one fixed random batch (forward + backward + AdamW step). All variants are
alive at once and timed interleaved repeat by repeat (warm-up rounds dropped) so they share the
machine's load; the table gives medians with min-max, images/s, the ratio to the first variant,
the counted FLOPs of a step (convolutions and matmuls, torch's FLOP counter) and the achieved
GFLOP/s beside the measured fp32 matmul peak of the same run.

A variant is written ``channels:blocks:stem:input``, e.g. ``32-64-128-256:1:2:64`` = stages of
32/64/128/256 channels, one block per stage, stem stride 2, 64x64 inputs (the shipped config).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import torch

from app.tools.common import check_report_files, count_flops, interleaved_times, matmul_peak, summarize, write_reports
from tasks.base import build_head
from tasks.encoders import HanziCNN

DEFAULT_VARIANTS = (
    "32-64-128-256:1:1:64",
    "32-64-128-256:1:1:32",
    "32-64-128-256:1:2:64",
    "48-96-192-384:1:2:64",
    "32-64-128-256:2:2:64",
)


@dataclass(frozen=True)
class Variant:
    channels: tuple[int, ...]
    blocks: int
    stem_stride: int
    input_size: int

    @classmethod
    def parse(cls, text: str) -> "Variant":
        rule = "channels:blocks:stem:input, e.g. 32-64-128-256:1:2:64 (stem 1 or 2)"
        try:
            channels, blocks, stem, size = text.split(":")
            variant = cls(tuple(int(c) for c in channels.split("-")), int(blocks), int(stem), int(size))
        except ValueError:
            raise ValueError(f"--variants entry {text!r} is not {rule}") from None
        if variant.stem_stride not in (1, 2) or variant.blocks < 1 or variant.input_size < 8 or min(variant.channels) < 1:
            raise ValueError(f"--variants entry {text!r} is out of range: write {rule}, blocks >= 1, input >= 8")
        return variant

    @property
    def name(self) -> str:
        return f"{'-'.join(map(str, self.channels))}:{self.blocks}:{self.stem_stride}:{self.input_size}"


def training_step(variant: Variant, num_classes: int, batch: int, features: int):
    """A closure running one forward + backward + AdamW step of ``variant`` on a fixed batch."""
    encoder = HanziCNN(
        out_features=features, channels=list(variant.channels), blocks_per_stage=variant.blocks,
        stem_stride=variant.stem_stride,
    )
    head = build_head("softmax", features, num_classes)
    optimizer = torch.optim.AdamW([*encoder.parameters(), *head.parameters()], lr=1e-3)
    x = torch.rand(batch, 1, variant.input_size, variant.input_size)
    y = torch.randint(0, num_classes, (batch,))

    def step() -> None:
        loss = head(encoder(x), y).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app bench hanzi", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated channels:blocks:stem:input")
    parser.add_argument("--num_classes", type=int, default=3755)
    parser.add_argument("--features", type=int, default=256, help="encoder output width (the head's input)")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the results here (atomically)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    check_report_files(args)  # before anything is measured
    for name, value, low in (("--num_classes", args.num_classes, 2), ("--batch_size", args.batch_size, 1),
                             ("--repeats", args.repeats, 1), ("--threads", args.threads, 1), ("--warmup", args.warmup, 0)):
        if value < low:
            raise ValueError(f"{name} {value} must be >= {low}")
    variants = [Variant.parse(text.strip()) for text in args.variants.split(",") if text.strip()]
    if not variants:
        raise ValueError(f"--variants {args.variants!r} names no variant; write e.g. 32-64-128-256:1:2:64")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    steps = {v.name: training_step(v, args.num_classes, args.batch_size, args.features) for v in variants}
    flops = {name: count_flops(step) for name, step in steps.items()}
    times = interleaved_times(steps, args.warmup, args.repeats)
    peak = matmul_peak()
    rows = []
    for v in variants:
        stats = summarize(times[v.name])
        rows.append({
            **asdict(v), "name": v.name, "step_ms": stats["median"] * 1e3, "min_ms": stats["min"] * 1e3,
            "max_ms": stats["max"] * 1e3, "images_per_s": args.batch_size / stats["median"],
            "gflop_per_step": flops[v.name] / 1e9, "gflop_per_s": flops[v.name] / stats["median"] / 1e9,
        })
    base = rows[0]["images_per_s"]
    print(f"HanziCNN training throughput: batch {args.batch_size}, {args.num_classes} classes, softmax head, "
          f"threads={args.threads}, {args.repeats} repeats (median, min-max); measured fp32 matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s")
    print("| channels:blocks:stem:input | step ms (min-max) | images/s | vs first | GFLOP/step | GFLOP/s | % of matmul peak |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        r["vs_first"] = r["images_per_s"] / base
        r["peak_fraction"] = r["gflop_per_s"] * 1e9 / peak
        print(f"| {r['name']} | {r['step_ms']:.0f} ({r['min_ms']:.0f}-{r['max_ms']:.0f}) | {r['images_per_s']:.1f} | "
              f"{r['vs_first']:.2f}x | {r['gflop_per_step']:.2f} | {r['gflop_per_s']:.1f} | {100 * r['peak_fraction']:.0f} % |")
    write_reports({"matmul_peak_gflops": peak / 1e9, "threads": args.threads, "rows": rows}, json_path=args.json)
    return 0
