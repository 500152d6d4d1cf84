"""python -m app demo: trains each head on the synthetic language and prints the comparison table."""

from __future__ import annotations

from app.demo import main

TINY = [
    "--data.init_args.train_tokens", "1500", "--data.init_args.valid_tokens", "400",
    "--data.init_args.test_tokens", "600", "--data.init_args.vocab_size", "40",
    "--model.init_args.encoder.init_args.hidden_size", "16", "--model.init_args.encoder.init_args.last_hidden_size", "16",
    "--model.init_args.encoder.init_args.embedding_dim", "8", "--trainer.enable_progress_bar", "false",
]


def test_demo_prints_the_table_the_floor_and_the_log_directory(tmp_path, capsys):
    save = tmp_path / "demo"
    assert main(["--heads", "softmax", "mos", "--max-epochs", "1", "--save-dir", str(save), "--extra", *TINY]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| softmax") or line.startswith("| mos")]
    assert len(table) == 2
    for line in table:
        ratio = float(line.split("|")[5])
        assert ratio >= 1.0  # no model beats the true distribution
    assert "Best possible softmax of width 8" in out and "past\nthe bottleneck:" in out
    assert (save / "SyntheticLM-softmax").is_dir() and (save / "SyntheticLM-mos").is_dir()
    assert "tensorboard --logdir" in out


def test_demo_prints_no_warning_nor_callback_override_notice(tmp_path):
    """``python -m app demo`` fits then tests each head on one Trainer: the task's own callbacks
    (``NonFiniteGuard``, ``TrainingRandomState``) are added once, so Lightning's "callbacks returned in
    `LightningModule.configure_callbacks` will override existing callbacks" is not printed, nor any warning."""
    import re

    from tests.shell import run_cli

    done = run_cli(["demo", "--heads", "softmax", "--max-epochs", "1", "--no-floor", "--save-dir", str(tmp_path / "demo"),
                    "--extra", *TINY, "--trainer.log_every_n_steps", "1"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| softmax" in done.stdout
    warned = [line for line in done.stderr.splitlines()
              if re.search(r"\.py:\d+: |Warning|Tip:|deprecated|recommended|will override", line)]
    assert warned == [], warned
