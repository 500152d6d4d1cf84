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
