"""app.runtime.ranks: the command waits for the DDP ranks its launcher started, and kills one that
outlives the grace period with one line on stderr (the two-process runs through the CLI are in
tests/test_runs.py and tests/test_ddp_*.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

from app.runtime import ranks


def trainer_with(*procs: subprocess.Popen) -> SimpleNamespace:
    """What ranks reads of a Trainer: strategy.launcher.procs, as Lightning's subprocess launcher keeps them."""
    return SimpleNamespace(strategy=SimpleNamespace(launcher=SimpleNamespace(procs=list(procs))))


def child(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_a_rank_that_ends_within_the_grace_period_is_waited_for_and_not_killed(capsys):
    proc = child(1.0)
    ranks.watch(trainer_with(proc))
    started = time.monotonic()
    assert ranks.wait_for_launched_ranks(failed=False) == []
    assert proc.returncode == 0 and time.monotonic() - started >= 0.5
    assert capsys.readouterr().err == ""


def test_a_rank_still_running_after_the_grace_period_is_killed_with_one_line(capsys, monkeypatch):
    monkeypatch.setattr(ranks, "GRACE_AFTER_ERROR", 0.5)
    proc = child(60)
    ranks.watch(trainer_with(proc))
    assert ranks.wait_for_launched_ranks(failed=True) == [proc.pid]
    assert proc.poll() is not None and proc.returncode != 0
    assert capsys.readouterr().err == f"rank 1 (pid {proc.pid}) was still running 0.5 s after rank 0 ended; killed it\n"
    assert ranks.wait_for_launched_ranks(failed=True) == []  # watched trainers are forgotten once waited for


def test_a_trainer_without_a_subprocess_launcher_has_nothing_to_wait_for():
    ranks.watch(SimpleNamespace(strategy=SimpleNamespace(launcher=None)))
    assert ranks.wait_for_launched_ranks(failed=False) == []
