"""The README's main job: train small language models with each head on the embedded
synthetic language and print how close each gets to the language's true perplexity.

``python -m app demo [--heads softmax mos ...] [--max-epochs N] [--save-dir runs/demo]``
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

from app.analyze.floor import fit_softmax, true_distributions
from app.cli import run_command
from app.runtime.directories import check_writable_directory
from datamodules.lm_synthetic import SyntheticLM
from heads.registry import COMPARED_FAMILIES, check_heads, list_heads

ROOT = Path(__file__).resolve().parent.parent


def head_config(head: str) -> Path:
    """The head's overlay the demo composes with the task config."""
    return ROOT / "configs" / "heads" / f"{head}.yaml"


def demo_heads() -> list[str]:
    """The heads ``--heads`` takes: every trainable registered head with a config in configs/heads/."""
    return [head for head in list_heads(trainable=True) if head_config(head).exists()]


def default_heads() -> list[str]:
    """The registry's :data:`~heads.registry.COMPARED_FAMILIES` (softmax, adaptive softmax and the heads that break
    the bottleneck)."""
    return [head for head in list_heads(COMPARED_FAMILIES, trainable=True) if head in demo_heads()]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app demo", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--heads", nargs="+", default=None, help="heads to compare (default: softmax, adaptive softmax and the bottleneck heads)")
    parser.add_argument("--config", default=str(ROOT / "configs/lm/synthetic.yaml"), help="task + data config")
    parser.add_argument("--max-epochs", type=int, default=None, help="override the config's trainer.max_epochs")
    parser.add_argument("--save-dir", default="runs/demo", help="TensorBoard log directory")
    parser.add_argument("--no-floor", dest="floor", action="store_false", help="skip the softmax-floor fit (about 15 s)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further CLI overrides for every run")
    args = parser.parse_args(argv)
    if args.max_epochs is not None and args.max_epochs < 1:  # named as the demo's option, not trainer.max_epochs
        raise ValueError(
            f"invalid value {args.max_epochs} for --max-epochs: expected an integer >= 1, the epochs each head trains "
            f"(fix --max-epochs, or leave it out for the config's trainer.max_epochs)"
        )
    return args


def train_one(config: str, head: str, args: argparse.Namespace) -> dict[str, float | str]:
    overrides = [
        "--trainer.logger.init_args.save_dir", args.save_dir,
        "--trainer.default_root_dir", args.save_dir,
        "--trainer.enable_model_summary", "false",
    ]
    if args.max_epochs is not None:
        overrides += ["--trainer.max_epochs", str(args.max_epochs)]
    cli = run_command(["--config", config, "--config", str(head_config(head)), *overrides, *args.extra], run=False)
    params = sum(p.numel() for p in cli.model.head.parameters())
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    seconds = time.perf_counter() - start
    results = cli.trainer.test(cli.model, datamodule=cli.datamodule, ckpt_path="best", verbose=False)[0]
    return {
        "head": head,
        "width": getattr(cli.model.head, "output_embedding_dim", None),
        "data": cli.datamodule,
        "head_params": params,
        "test_ppl": results["test/ppl"],
        "true_ppl": results.get("test/true_ppl", math.nan),
        "ratio": results.get("test/ppl_over_true", math.nan),
        "acc@1": results.get("test/acc@1", math.nan),
        "train_s": seconds,
        "log_dir": cli.trainer.logger.log_dir,
    }


def table(rows: list[dict[str, float | str]]) -> str:
    lines = [
        "| head | head params | test ppl | true ppl | ppl / true ppl | top-1 acc | train time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['head']} | {r['head_params']:,} | {r['test_ppl']:.2f} | {r['true_ppl']:.2f} | "
            f"{r['ratio']:.3f} | {r['acc@1']:.3f} | {r['train_s']:.0f} |"
        )
    return "\n".join(lines)


def floor_line(rows: list[dict]) -> str:
    """The best ppl / true ppl any softmax of the softmax row's width can reach on this language
    (a quick ``analyze floor`` fit), and which heads went below it."""
    base = next((r for r in rows if r["head"] == "softmax"), rows[0])
    if not isinstance(base["data"], SyntheticLM) or not base["width"]:
        return "(no softmax floor: the data is not the synthetic language)"
    log_p = true_distributions(base["data"], contexts=1000)
    entropy = float(-(log_p.exp() * log_p).sum(1).mean())
    floor = math.exp(fit_softmax(log_p, base["width"], iterations=1500, restarts=1)[1] - entropy)
    below = [r["head"] for r in rows if r["ratio"] < floor]
    return (
        f"\nBest possible softmax of width {base['width']} on this language, with a perfect encoder: {floor:.3f}x the\n"
        f"true perplexity (quick fit; `python -m app analyze floor` for the careful one). Below it, i.e. past\n"
        f"the bottleneck: {', '.join(below) if below else 'no head'}."
    )


def main(argv: list[str]) -> int:
    args = parse(argv)
    heads = args.heads or default_heads()
    check_heads(heads, demo_heads(), "--heads")
    check_writable_directory(args.save_dir, "save-dir")
    os.makedirs(args.save_dir, exist_ok=True)
    rows = [train_one(args.config, head, args) for head in heads]
    print(f"\nSynthetic high-rank language ({args.config}): test perplexity per head\n")
    print(table(rows))
    print(
        "\nppl / true ppl = 1 means the model matches the language's own next-token distribution; a\n"
        "softmax (and MoC) whose class embeddings are narrower than the language's rank cannot get there\n"
        "(the softmax bottleneck, Yang et al. 2018)."
    )
    if args.floor:
        print(floor_line(rows))
    print(f"\nTensorBoard logs: {os.path.abspath(args.save_dir)}")
    print(f"Open them with:   .venv/bin/tensorboard --logdir {args.save_dir}   (then browse http://localhost:6006)")
    return 0
