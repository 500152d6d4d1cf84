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
    """What ranks reads of a Trainer: strategy.launcher.procs, as Lightning's subprocess launcher keeps them
    (the launcher exists when the Trainer is built; its procs list is filled at launch)."""
    launcher = SimpleNamespace(procs=[])
    trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=launcher))
    ranks.watch(trainer)
    launcher.procs.extend(procs)
    return trainer


def child(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_a_rank_that_ends_within_the_grace_period_is_waited_for_and_not_killed(capsys):
    proc = child(1.0)
    trainer_with(proc)
    started = time.monotonic()
    assert ranks.wait_for_launched_ranks(failed=False) == []
    assert proc.returncode == 0 and time.monotonic() - started >= 0.5
    assert capsys.readouterr().err == ""


def test_a_rank_still_running_after_the_grace_period_is_killed_with_one_line(capsys, monkeypatch):
    monkeypatch.setattr(ranks, "GRACE_AFTER_ERROR", 0.5)
    proc = child(60)
    trainer_with(proc)
    assert ranks.wait_for_launched_ranks(failed=True) == [proc.pid]
    assert proc.poll() is not None and proc.returncode != 0
    assert capsys.readouterr().err == f"rank 1 (pid {proc.pid}) was still running 0.5 s after rank 0 ended; killed it\n"
    assert ranks.wait_for_launched_ranks(failed=True) == []  # watched trainers are forgotten once waited for


def test_the_grace_period_is_one_deadline_for_all_ranks(capsys, monkeypatch):
    monkeypatch.setattr(ranks, "GRACE_AFTER_ERROR", 1.0)
    procs = [child(60) for _ in range(3)]
    trainer_with(*procs)
    started = time.monotonic()
    assert ranks.wait_for_launched_ranks(failed=True) == [p.pid for p in procs]
    assert time.monotonic() - started < 2.5  # not three grace periods one after the other
    assert len(capsys.readouterr().err.splitlines()) == 3


def test_lightnings_observer_is_retired_before_the_wait_so_it_cannot_kill_rank_0():
    """Lightning's observer SIGKILLs the children and the main process once a child exits non-zero;
    the wait leaves it nothing to observe. (Its target is a stand-in process, not this one.)"""
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    stand_in = child(60)
    failing = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1); sys.exit(2)"])
    observer = _ChildProcessObserver(main_pid=stand_in.pid, child_processes=[failing], sleep_period=1)
    observer.start()
    trainer_with(failing)
    ranks.wait_for_launched_ranks(failed=True)
    observer.join(timeout=5)
    assert not observer.is_alive() and failing.returncode == 2
    try:
        stand_in.wait(timeout=3)  # a SIGKILL takes a moment to land
    except subprocess.TimeoutExpired:
        stand_in.kill()
        stand_in.wait()
    else:
        raise AssertionError("the observer killed the process it guards")


def test_a_trainer_without_a_subprocess_launcher_has_nothing_to_wait_for():
    ranks.watch(SimpleNamespace(strategy=SimpleNamespace(launcher=None)))
    assert ranks.wait_for_launched_ranks(failed=False) == []
