"""``python -m app bench mitosis``: the head's training memory while mitosis grows DS-64 from DS-2.

Trains the captions language model (``configs/lm/multi30k_captions.yaml``) with the shipped
``configs/heads/ds64.yaml`` (the same Mitosis / GroupLassoPruning stage schedule, lassos and
balancing), with the stages shortened so the run fits in minutes: a cloning every
``--every_n_steps`` steps, pruning from ``--after_cloning`` steps after each cloning, every
``--prune_every`` steps, and one more stage after the last cloning. The memory is the head's
parameters + gradients + optimizer state against a full softmax of the same ``V`` and ``d``
with the same optimizer (:mod:`heads.ds.memory`), measured after every optimizer step and at
each cloning. Prints the peak ratio and the ratio at each cloning; ``--json FILE`` writes them
(``peak_ratio``, ``clonings``), and the run directory gets the Fig. 6a-style plot.
``--tiny`` runs the generated LM (``configs/lm/synthetic.yaml``) at test size instead.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--config", str(ROOT / "configs/lm/synthetic.yaml"), "--config", str(ROOT / "configs/heads/ds64.yaml"),
    "--data.init_args.vocab_size", "40", "--data.init_args.train_tokens", "2000",
    "--data.init_args.valid_tokens", "400", "--data.init_args.test_tokens", "400",
    "--data.init_args.batch_size", "4", "--data.init_args.eval_batch_size", "4", "--data.init_args.bptt", "8",
    "--model.init_args.encoder.init_args.embedding_dim", "8", "--model.init_args.encoder.init_args.hidden_size", "16",
    "--model.init_args.encoder.init_args.num_layers", "1", "--model.init_args.encoder.init_args.last_hidden_size", "8",
    "--model.init_args.head.init_args.group_lasso_weight", "0.01", "--model.init_args.head.init_args.expert_lasso_weight", "0.01",
]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app bench mitosis", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--every_n_steps", type=int, default=None, help="steps between clonings (default 120; --tiny 4)")
    parser.add_argument("--after_cloning", type=int, default=None, help="steps from a cloning to its stage's pruning (default 60; --tiny 2)")
    parser.add_argument("--prune_every", type=int, default=None, help="steps between pruning passes (default 10; --tiny 1)")
    parser.add_argument("--data_dir", default=None, help="Multi30K directory (default: the config's ../shared/data/multi30k)")
    parser.add_argument("--output_dir", default="runs/bench_mitosis", help="where the run (logs, plot) goes")
    parser.add_argument("--tiny", action="store_true", help="generated tiny LM, seconds (tests)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from app.tools.common import check_report_files

    check_report_files(args)  # before anything is measured
    every = args.every_n_steps or (4 if args.tiny else 120)
    after = args.after_cloning if args.after_cloning is not None else (2 if args.tiny else 60)
    prune_every = args.prune_every or (1 if args.tiny else 10)
    for key, value in (("every_n_steps", every), ("prune_every", prune_every)):
        if value < 1:
            raise ValueError(f"bench mitosis needs --{key} >= 1, got {value}")
    if not 0 <= after < every:
        raise ValueError(f"bench mitosis needs 0 <= --after_cloning < --every_n_steps ({every}), got {after}")

    import lightning as L

    from app.main import main as app_main
    from tasks.callbacks import GroupLassoPruning, Mitosis

    L.seed_everything(args.seed, verbose=False)
    config = TINY if args.tiny else [
        "--config", str(ROOT / "configs/lm/multi30k_captions.yaml"), "--config", str(ROOT / "configs/heads/ds64.yaml")]
    if args.data_dir and not args.tiny:
        config += ["--data.init_args.data_dir", args.data_dir]
    out = Path(args.output_dir)
    cli = app_main([*config, "--trainer.max_epochs", "1000", "--trainer.limit_val_batches", "0",
                    "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
                    "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(out),
                    "--trainer.logger.init_args.save_dir", str(out), "--trainer.log_every_n_steps", "10"], run=False)
    mitosis = next(c for c in cli.trainer.callbacks if isinstance(c, Mitosis))
    pruning = next(c for c in cli.trainer.callbacks if isinstance(c, GroupLassoPruning))
    head = cli.model.head
    stages = mitosis.clonings(head.initial_experts) + 1
    mitosis.every_n_steps, pruning.after_cloning, pruning.every_n_steps = every, after, prune_every
    cli.trainer.fit_loop.epoch_loop.max_steps = every * stages  # one more stage after the last cloning
    start = time.perf_counter()
    cli.trainer.fit(cli.model, cli.datamodule)
    seconds = time.perf_counter() - start
    report = {
        "task": "synthetic LM (tiny)" if args.tiny else "multi30k captions LM",
        "num_classes": head.num_classes, "in_features": head.in_features,
        "initial_experts": head.initial_experts, "final_experts": head.num_experts,
        "every_n_steps": every, "after_cloning": after, "prune_every": prune_every,
        "steps": cli.trainer.global_step, "seconds": round(seconds, 1),
        "peak_ratio": mitosis.peak_ratio,
        "final_ratio": mitosis.memory_history[-1][1] if mitosis.memory_history else math.nan,
        "final_kept_rows": int(head.rows_per_expert().sum()),
        "clonings": [{"step": int(r["step"]), "num_experts": int(r["num_experts"]), "kept_rows": int(r["kept_rows"]),
                      "ratio": r["ratio"]} for r in mitosis.memory_report],
        "plot": str(Path(cli.trainer.log_dir or out) / "mitosis_memory.png"),
    }
    print(f"mitosis memory, {report['task']}: V={head.num_classes}, d={head.in_features}, "
          f"DS-{head.initial_experts} -> DS-{head.num_experts} in {report['steps']} steps ({seconds:.0f} s)")
    print(f"{'step':>6} {'experts':>7} {'kept rows':>10} {'memory / full softmax':>22}")
    for row in report["clonings"]:
        print(f"{row['step']:>6} {row['num_experts']:>7} {row['kept_rows']:>10} {row['ratio']:>21.2f}x")
    print(f"peak over the run: {report['peak_ratio']:.2f}x a full softmax (params + grads + optimizer state); "
          f"at the end {report['final_ratio']:.2f}x; plot: {report['plot']}")
    if args.json:
        from datamodules.files import write_atomically

        write_atomically(args.json, json.dumps(report, indent=2) + "\n", what="bench mitosis JSON")
    return 0
