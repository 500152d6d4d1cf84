"""Real DDP on CPU (two gloo processes) from the command line, as a user would run it."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.test_cli import PTB, TINY_LM, write_corpus

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_two_process_ddp_fit_counts_every_validation_token_once(tmp_path):
    data = write_corpus(tmp_path / "corpus", PTB, lines=60)
    words = sum(len(line.split()) + 1 for line in (data / "ptb.valid.txt").read_text().splitlines())
    args = [
        sys.executable, "-m", "app", "fit", "--config", str(ROOT / "configs/lm/ptb.yaml"), *TINY_LM,
        "--data.init_args.data_dir", str(data), "--trainer.limit_val_batches", "1.0",
        "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = glob.glob(str(tmp_path / "runs" / "*" / "version_0"))[0]
    events = EventAccumulator(run)
    events.Reload()
    # One stream of `words` tokens has words - 1 targets, split across the two ranks.
    assert events.Scalars("val/tokens")[-1].value == words - 1
