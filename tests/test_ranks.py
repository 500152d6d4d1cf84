"""app.runtime.ranks: the command waits for the DDP ranks its launcher started, and kills one that
outlives the grace period with one line on stderr (the two-process runs through the CLI are in
tests/test_runs.py and tests/test_ddp_*.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from lightning.pytorch.strategies import DDPStrategy

from app.main import main
from app.runtime import ranks
from app.runtime.signals import resume_command
from tests.shell import ROOT


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


def stopped_child() -> subprocess.Popen:
    """A child process stopped by SIGSTOP (returned once /proc shows it stopped)."""
    proc = child(60)
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while ranks.process_state(proc.pid) != "T":
        assert time.monotonic() < deadline, ranks.process_state(proc.pid)
        time.sleep(0.01)
    return proc


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


def test_a_stopped_rank_is_killed_at_once_not_after_the_grace_period(capsys):
    proc = stopped_child()
    trainer_with(proc)
    started = time.monotonic()
    assert ranks.wait_for_launched_ranks(failed=False) == [proc.pid]  # grace: 120 s
    assert time.monotonic() - started < 5 and proc.returncode == -signal.SIGKILL
    assert capsys.readouterr().err == f"rank 1 (pid {proc.pid}) is stopped and would never end; killed it\n"


# ---------------------------------------------------------------------------------- collectives that give up
DDP_ON_CPU = ["--config", str(ROOT / "configs/lm/synthetic.yaml"), "--trainer.accelerator", "cpu", "--trainer.devices", "2"]


@pytest.mark.parametrize("strategy", [["--trainer.strategy", "ddp"], ["--trainer.strategy", "ddp_find_unused_parameters_true"], []],
                         ids=["ddp", "ddp-by-another-name", "auto"])
def test_a_ddp_strategy_chosen_by_name_gets_the_project_timeout(strategy, monkeypatch):
    """Lightning builds a named strategy with PyTorch's 30-minute default and keeps the value in
    DDPStrategy._timeout until the process group starts (the private attribute
    ranks.limit_collective_wait sets: this pins it)."""
    monkeypatch.setattr(ranks, "_TIMEOUT", [])  # what this trainer sets stays in the test
    cli = main([*DDP_ON_CPU, *strategy], run=False)
    assert isinstance(cli.trainer.strategy, DDPStrategy)
    assert cli.trainer.strategy._timeout == ranks.DEFAULT_TIMEOUT == timedelta(minutes=5)
    ranks.wait_for_launched_ranks(failed=False)  # forget the launcher watched for this trainer


def test_a_timeout_given_with_the_strategy_class_is_kept(monkeypatch):
    monkeypatch.setattr(ranks, "_TIMEOUT", [])
    cli = main([*DDP_ON_CPU, "--trainer.strategy", "DDPStrategy", "--trainer.strategy.init_args.timeout", "0:00:42"], run=False)
    assert cli.trainer.strategy._timeout == timedelta(seconds=42)
    line = ranks.stalled_collective_line(RuntimeError("Application timeout caused pair closure"),
                                         resume_command(["fit", "--config", "c.yaml"]))
    assert line == ("a rank did not answer: a DDP collective waited the process-group timeout (0:00:42) and gave up, so the "
                    "run ended; resume with: python -m app fit --config c.yaml --ckpt_path last (a longer wait: "
                    "--trainer.strategy.init_args.timeout, see docs/ddp.md)")
    ranks.wait_for_launched_ranks(failed=False)


def test_a_collective_that_gave_up_names_the_stopped_rank_and_other_errors_are_left_alone(monkeypatch):
    monkeypatch.setattr(ranks, "_TIMEOUT", [timedelta(seconds=20)])
    proc = stopped_child()
    trainer_with(proc)
    try:
        line = ranks.stalled_collective_line(RuntimeError("[gloo] Timed out waiting 20000ms for recv operation"),
                                            resume_command(["fit"]))
        assert line.startswith(f"rank 1 (pid {proc.pid}) is stopped (SIGSTOP or a debugger): a DDP collective waited "
                               f"the process-group timeout (0:00:20)")
        assert "resume with: python -m app fit --ckpt_path last" in line and "\n" not in line
        assert ranks.stalled_collective_line(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "") is None
        assert ranks.stalled_collective_line(ValueError("timed out"), "") is None
    finally:
        ranks.wait_for_launched_ranks(failed=True)  # kills the stopped child
