"""A config written for a task's former flat signature is refused with one line that says where
each argument is set today (the renames of CHANGELOG.md), not only that it is unknown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.compat import moved_option

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("task", "option", "expected"),
    [
        ("tasks.LanguageModel", "dropout_hidden", "model.init_args.encoder.init_args.dropout_hidden"),
        ("tasks.LanguageModel", "transformer_heads", "model.init_args.encoder.init_args.num_heads"),
        ("tasks.language_model.LanguageModel", "hidden_size",
         "model.init_args.encoder.init_args.hidden_size (AWDLSTMEncoder) or "
         "model.init_args.encoder.init_args.feedforward_dim (TransformerLMEncoder)"),
        ("tasks.translation.TranslationTask", "hidden_size", "model.init_args.network.init_args.hidden_size"),
        ("tasks.TranslationTask", "embed_dim", "model.init_args.network.init_args.embed_dim (TransformerSeq2Seq: d_model)"),
        ("tasks.CaptioningTask", "attention_dim", "model.init_args.decoder.init_args.attention_dim"),
        ("tasks.CaptioningTask", "freeze_encoder", "model.init_args.encoder.init_args.trainable (negated)"),
        ("tasks.LanguageModel", "bogus", None),
        ("tasks.ClassificationTask", "hidden_size", None),
    ],
)
def test_moved_option_names_the_new_key(task, option, expected):
    assert moved_option(task, option) == expected


def test_a_flat_language_model_config_is_one_line_naming_the_encoder_key(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  init_args:\n    dropout_hidden: 0.1\n")
    result = subprocess.run(
        [sys.executable, "-m", "app", "fit", "--config", str(ROOT / "configs/lm/synthetic.yaml"), "--config", str(old),
         "--trainer.fast_dev_run", "true", "--trainer.default_root_dir", str(tmp_path)],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (
        "error: model tasks.LanguageModel: Option 'dropout_hidden' moved to "
        "model.init_args.encoder.init_args.dropout_hidden (renames are listed in CHANGELOG.md)"
    ), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "lightning_logs").exists() and not list(tmp_path.glob("runs/*/*/*.ckpt"))
