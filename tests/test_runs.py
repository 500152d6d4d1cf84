"""Runs resume and stop as documented, through the real CLI (signals and concurrent runs in processes of their own, marked slow).

* the Resume > Commands of docs/reliability.md, run verbatim with the default directories, continue
  the newest run of the configuration (same ``version_N``, same TensorBoard stream, the global step
  goes on), and ``--ckpt_path last`` with nothing to resume is a one-line error;
* SIGTERM and SIGINT in the middle of an epoch write a checkpoint, print the resume command and
  exit 143 / 130; that command resumes to the same parameters as a run never interrupted;
* two runs on one ``--checkpoint.dirpath`` at once: the second is refused with a line naming the
  first (``app/runtime/locks.py``); leftovers of an interrupted checkpoint write are removed at the next
  start, and a stale lock of a dead run is taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.main import main
from app.runtime.signals import ANSWER_WITHIN
from tests.shell import ENV, run_app, run_cli
from tests.test_resume import TINY_SYNTHETIC, assert_resumed_equals, callbacks_config

ROOT = Path(__file__).resolve().parent.parent
RECORD = "tests.test_resume.RecordFinal"


class Pace(pl.Callback):
    """Sleeps ``delay`` seconds after every training step (or, with ``during="validation"``,
    every batch of a validation that is not the sanity check) and writes the global step to
    ``marker``: keeps a tiny run alive long enough to be signalled mid-epoch, and tells the test
    that it got there. Changes nothing in the training itself."""

    def __init__(self, delay: float, marker: str, during: str = "training") -> None:
        self.delay, self.marker, self.during = delay, marker, during

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.during == "training":
            self._pace(trainer)

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.during == "validation" and not trainer.sanity_checking:
            self._pace(trainer)

    def _pace(self, trainer: pl.Trainer) -> None:
        Path(self.marker).write_text(str(trainer.global_step))
        time.sleep(self.delay)


class FailAt(pl.Callback):
    """Raises a one-line user error (``ValueError``) after training step ``step``, as bad data met
    mid-epoch or a full disk does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            raise ValueError(f"stopped at step {trainer.global_step} on purpose")


def start_app(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """``python -m app ARGS`` in the background, stdout (the progress bar) and stderr to ``log``."""
    with open(log, "w") as handle:
        return subprocess.Popen([sys.executable, "-m", "app", *args], cwd=cwd, env=ENV, stdout=handle,
                                stderr=subprocess.STDOUT, text=True)


def read_log(log: Path) -> str:
    """A log being written (a progress bar's multi-byte characters may be cut at the end)."""
    return log.read_text(errors="replace")


def wait_for(condition, process: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended before the test could signal it:\n{read_log(log)[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting:\n{read_log(log)[-3000:]}"
        time.sleep(0.05)


def global_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


def logged_steps(event_file: Path, tag: str = "train/loss") -> list[int]:
    events = EventAccumulator(str(event_file))
    events.Reload()
    return [s.step for s in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


# ------------------------------------------------------------------ the documented commands
def documented_commands() -> list[list[str]]:
    """The two command lines of docs/reliability.md, Resume > Commands (fresh run, resume)."""
    text = (ROOT / "docs/reliability.md").read_text()
    section = text.split("### Commands", 1)[1].split("```", 2)[1]
    lines = [line for line in section.splitlines() if line.startswith("python -m app ")]
    assert len(lines) == 2 and lines[1].endswith("--ckpt_path last"), lines
    return [shlex.split(line)[3:] for line in lines]


def progress_bar_steps(text: str) -> list[int]:
    """The batch counts of the training progress lines a run writes to a log file (stdout not a
    terminal: ``Epoch 0: 27/536 (5%) ...``, :class:`app.runtime.progress.LineProgressBar`)."""
    return [int(n) for n in re.findall(r"^Epoch \d+: (\d+)/", text, flags=re.MULTILINE)]


@pytest.mark.slow  # signals to a process of its own
def test_documented_resume_command_continues_the_newest_run_in_its_version_directory(tmp_path):
    """Verbatim from the docs, cwd a fresh directory holding a copy of the config: the run is
    stopped by SIGTERM once it trains, the resume command continues in runs/<name>/version_0
    (no version_1), its TensorBoard events continue the step count, and it is stopped again
    later: its checkpoint is further on than the first."""
    first, resume = documented_commands()
    config = next(arg for arg in first if arg.endswith(".yaml"))
    (tmp_path / config).parent.mkdir(parents=True)
    shutil.copy(ROOT / config, tmp_path / config)
    run_dir = tmp_path / "runs" / "SyntheticLM-softmax" / "version_0"
    last = run_dir / "checkpoints" / "last.ckpt"

    log = tmp_path / "first.log"
    process = start_app(first, tmp_path, log)
    # Past a few train/loss logging steps (every 10 steps by default), in both runs.
    wait_for(lambda: max(progress_bar_steps(read_log(log)), default=0) >= 25, process, log)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143, read_log(log)[-3000:]
    saved = global_step(last)
    assert saved >= 25

    log = tmp_path / "resume.log"
    process = start_app(resume, tmp_path, log)
    wait_for(lambda: max(progress_bar_steps(read_log(log).partition("Restored all states")[2]), default=0) > saved + 25,
             process, log)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143, read_log(log)[-3000:]
    assert str(last) in read_log(log), "the resumed run checkpoints into the run it resumed"
    resumed_lines = [line for line in read_log(log).splitlines() if re.match(r"Epoch \d+: \d+/", line)]
    assert resumed_lines and not [line for line in resumed_lines if " 0.0 it/s" in line], resumed_lines  # rate of this process

    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["version_0"], "resume must not start a new version"
    resumed = global_step(last)
    assert resumed > saved
    first_events, resumed_events = sorted(run_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    before, after = logged_steps(first_events), logged_steps(resumed_events)
    assert before and max(before) < saved, (saved, before)
    assert after and min(after) >= saved and max(after) > saved + 10, (saved, before, after)


def test_resume_last_with_nothing_to_resume_is_one_line_and_creates_nothing(tmp_path):
    done = run_cli(["fit", "--config", str(ROOT / "configs/lm/synthetic.yaml"), "--ckpt_path", "last"], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    expected = (f"error: --ckpt_path last: no checkpoint to resume in "
                f"{tmp_path / 'runs' / 'SyntheticLM-softmax' / 'version_*' / 'checkpoints'}; "
                f"start a fresh run without --ckpt_path")
    assert lines == [expected], done.stderr[-3000:]
    assert list(tmp_path.iterdir()) == [], "a refused resume must not create anything"


def test_resume_last_with_an_empty_checkpoint_dirpath_is_refused(tmp_path):
    done = run_cli(["fit", *TINY_SYNTHETIC, "--checkpoint.dirpath", str(tmp_path / "ckpt"), "--ckpt_path", "last"],
                   tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: --ckpt_path last: no checkpoint to resume in {tmp_path / 'ckpt'} (checkpoint.dirpath); "
        f"start a fresh run without --ckpt_path"]


# ------------------------------------------------------------------ pre-emption
@pytest.fixture(scope="module")
def uninterrupted_one_epoch(tmp_path_factory) -> dict[str, Any]:
    """The tiny run of one epoch (8 windows) left alone: final parameters and val/loss."""
    directory = tmp_path_factory.mktemp("straight")
    main(["fit", *TINY_SYNTHETIC, "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(directory),
          "--trainer.logger.init_args.save_dir", str(directory / "runs"), "--config",
          str(callbacks_config(directory / "cb.yaml", [(RECORD, {"path": str(directory / "final.pt")})]))])
    return torch.load(directory / "final.pt")


@pytest.mark.slow  # signals to a process of its own
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_epoch_saves_a_checkpoint_prints_the_resume_command_and_that_command_resumes_exactly(
        tmp_path, signum, code, uninterrupted_one_epoch):
    marker = tmp_path / "step"
    paced = callbacks_config(tmp_path / "cb.yaml", [("tests.test_runs.Pace", {"delay": 0.6, "marker": str(marker)}),
                                                     (RECORD, {"path": str(tmp_path / "final.pt")})])
    args = ["fit", *TINY_SYNTHETIC, "--trainer.max_epochs", "1", "--config", str(paced)]
    log = tmp_path / "interrupted.log"
    process = start_app(args, tmp_path, log)
    wait_for(lambda: marker.exists() and marker.read_text() not in ("", "0", "1"), process, log)
    process.send_signal(signum)
    assert process.wait(timeout=120) == code, read_log(log)[-3000:]
    stderr = read_log(log)
    resume_line = next((line for line in stderr.splitlines() if line.startswith("resume with: ")), None)
    assert resume_line, stderr[-3000:]
    command = shlex.split(resume_line.removeprefix("resume with: "))
    assert command[:3] == ["python", "-m", "app"] and command[3:-2] == args and command[-2] == "--ckpt_path"
    checkpoint = Path(command[-1])
    assert checkpoint == tmp_path / "runs" / "SyntheticLM-softmax" / "version_0" / "checkpoints" / "last.ckpt"
    saved = global_step(checkpoint)
    assert 2 <= saved < 8, "stopped in the middle of the epoch"
    assert f"interrupted by {signal.Signals(signum).name} at global step {saved} (epoch 0)" in stderr
    assert not (tmp_path / "final.pt").exists(), "an interrupted fit must not run on to its end"
    assert not (checkpoint.parent / "run.lock").exists(), "the lock is released on a signal too"

    resumed = run_app(command[3:], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record = torch.load(tmp_path / "final.pt")
    assert record["global_step"] == uninterrupted_one_epoch["global_step"] == 8
    assert_resumed_equals(record, uninterrupted_one_epoch)
    assert sorted(p.name for p in checkpoint.parent.parent.parent.iterdir()) == ["version_0"]


@pytest.mark.slow  # signals to a process of its own
def test_sigterm_during_a_mid_epoch_validation_then_the_printed_command_resumes_exactly(tmp_path):
    """Validation every 4 steps; SIGTERM arrives between two validation batches at step 4, where
    Lightning's evaluation loop stops. The checkpoint is written mid-validation; the resumed run
    redoes that validation and ends with the uninterrupted run's parameters and val/loss."""
    args = [*TINY_SYNTHETIC, "--trainer.max_epochs", "1", "--trainer.val_check_interval", "4"]
    straight = tmp_path / "straight"
    straight.mkdir()
    main(["fit", *args, "--trainer.default_root_dir", str(straight), "--trainer.logger.init_args.save_dir",
          str(straight / "runs"), "--config",
          str(callbacks_config(straight / "cb.yaml", [(RECORD, {"path": str(straight / "final.pt")})]))])
    marker = tmp_path / "step"
    paced = callbacks_config(tmp_path / "cb.yaml", [
        ("tests.test_runs.Pace", {"delay": 0.5, "marker": str(marker), "during": "validation"}),
        (RECORD, {"path": str(tmp_path / "final.pt")})])
    log = tmp_path / "interrupted.log"
    process = start_app(["fit", *args, "--config", str(paced)], tmp_path, log)
    wait_for(marker.exists, process, log)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143, read_log(log)[-3000:]
    assert "interrupted by SIGTERM at global step 4 (epoch 0)" in read_log(log)
    command = shlex.split(next(line for line in read_log(log).splitlines() if line.startswith("resume with: "))
                          .removeprefix("resume with: "))
    resumed = run_app(command[3:], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record, uninterrupted = torch.load(tmp_path / "final.pt"), torch.load(straight / "final.pt")
    assert record["global_step"] == uninterrupted["global_step"] == 8
    assert_resumed_equals(record, uninterrupted)


@pytest.mark.slow  # signals to a process of its own
def test_sigterm_before_training_starts_exits_143_and_leaves_nothing(tmp_path):
    """A signal while the command is still starting (here right after the seed is set, before
    the trainer runs) stops it at once: exit 143, no checkpoint, no lock, no version directory."""
    log = tmp_path / "early.log"
    process = start_app(["fit", *TINY_SYNTHETIC, "--trainer.max_epochs", "1"], tmp_path, log)
    wait_for(lambda: "Seed set to 0" in read_log(log), process, log)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143, read_log(log)[-3000:]
    assert "interrupted by SIGTERM outside a training step, so no checkpoint was written" in read_log(log)
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("run.lock"))
    assert not list(tmp_path.rglob("version_*"))


# ------------------------------------------------------------------ concurrent runs
def test_the_locked_directory_is_the_one_lightning_writes_checkpoints_to(tmp_path):
    """``checkpoint_directory`` restates Lightning's private rule for the default checkpoint
    directory (``<save_dir>/<name>/version_N/checkpoints``); this pins the agreement."""
    from app.runtime.directories import checkpoint_directory

    cli = main(["fit", *TINY_SYNTHETIC, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "1",
                "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(tmp_path),
                "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")])
    expected = tmp_path / "runs" / "SyntheticLM-softmax" / "version_0" / "checkpoints"
    assert checkpoint_directory(cli.trainer) == Path(cli.trainer.checkpoint_callback.dirpath) == expected
    assert (expected / "last.ckpt").is_file() and not (expected / "run.lock").exists()


@pytest.mark.slow  # two processes at once
def test_two_runs_started_together_on_one_checkpoint_dirpath_one_is_refused_naming_the_other(tmp_path):
    shared = tmp_path / "ckpt"
    processes, logs = [], []
    for name in ("a", "b"):
        paced = callbacks_config(tmp_path / f"{name}.yaml", [
            ("tests.test_runs.Pace", {"delay": 0.25, "marker": str(tmp_path / f"{name}.step")}),
            (RECORD, {"path": str(tmp_path / f"{name}.pt")})])
        logs.append(tmp_path / f"{name}.log")
        processes.append(start_app(["fit", *TINY_SYNTHETIC, "--trainer.max_epochs", "1", "--checkpoint.dirpath",
                                    str(shared), "--config", str(paced)], tmp_path, logs[-1]))
    codes = [p.wait(timeout=300) for p in processes]
    assert sorted(codes) == [0, 2], [read_log(log)[-2000:] for log in logs]
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    refusal = read_log(logs[loser]).strip().splitlines()[-1]
    assert re.fullmatch(rf"error: checkpoint\.dirpath {re.escape(str(shared))} is in use by another run "
                        rf"\(pid {processes[winner].pid} on host .+, started .+: python -m app fit .*\): "
                        rf"wait for it to finish or pass another --checkpoint\.dirpath", refusal), refusal
    assert not (tmp_path / f"{'ab'[loser]}.pt").exists(), "the refused run must not train"
    # Every checkpoint in the directory is the winner's: its last.ckpt holds the winner's final weights.
    record = torch.load(tmp_path / f"{'ab'[winner]}.pt")
    last = torch.load(shared / "last.ckpt", map_location="cpu", weights_only=False)
    assert all(torch.equal(last["state_dict"][k], v) for k, v in record["params"].items())
    assert sorted(p.name for p in shared.iterdir()) == ["best-epoch=0-step=8.ckpt", "last.ckpt"], "lock released"
    # Either run may reserve version_0 first; the refused one gives its directory back.
    versions = list((tmp_path / "runs" / "SyntheticLM-softmax").iterdir())
    assert len(versions) == 1, "the refused run gives back the version directory it reserved"
    assert list(versions[0].glob("events.out.tfevents.*")), "the winner's logs are kept"


def test_leftover_temporary_files_and_a_stale_lock_are_cleaned_up_at_the_next_start(tmp_path):
    shared = tmp_path / "ckpt"
    shared.mkdir()
    leftover = shared / ".tmp-k3j2x9_a-last.ckpt"
    leftover.write_bytes(b"half a checkpoint")
    users = [shared / ".tmp-draft.txt", shared / ".tmp-k3j2x9_a-notes.txt"]  # the user's, not the writer's
    for path in users:
        path.write_text("mine")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {"pid": int(dead.stdout), "host": os.uname().nodename, "started": "-", "command": "python -m app fit"}
    (shared / "run.lock").write_text(json.dumps(stale))
    done = run_cli(["fit", *TINY_SYNTHETIC, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
                    "--trainer.limit_val_batches", "1", "--checkpoint.dirpath", str(shared)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "removed 1 unfinished checkpoint file(s) of an interrupted run" in done.stderr
    assert sorted(p.name for p in shared.iterdir()) == sorted(["best-epoch=0-step=2.ckpt", "last.ckpt", *(p.name for p in users)])
    assert all(path.read_text() == "mine" for path in users), "only the checkpoint writer's temporaries are removed"


@pytest.mark.slow
def test_sigterm_to_a_two_process_ddp_fit_stops_every_rank_and_the_printed_command_resumes(tmp_path):
    """SIGTERM to the launching process (rank 0) of a 2-process gloo run: Lightning forwards it to
    rank 1, both ranks stop at the same step, both join the checkpoint dump (the LSTM states of
    16 global rows are gathered), rank 0 writes it, the command exits 143 with no process left,
    and the printed command resumes to the end of the run."""
    marker = tmp_path / "step"
    paced = callbacks_config(tmp_path / "cb.yaml", [("tests.test_runs.Pace", {"delay": 0.3, "marker": str(marker)}),
                                                     (RECORD, {"path": str(tmp_path / "final.pt")})])
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
           "--data.init_args.batch_size", "8", "--data.init_args.eval_batch_size", "8"]
    args = ["fit", *TINY_SYNTHETIC, *ddp, "--trainer.max_epochs", "1", "--config", str(paced)]
    log = tmp_path / "interrupted.log"
    process = start_app(args, tmp_path, log)
    wait_for(lambda: marker.exists() and marker.read_text() not in ("", "0", "1"), process, log)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143, read_log(log)[-3000:]
    stray = subprocess.run(["pgrep", "-f", str(paced)], capture_output=True, text=True).stdout.split()
    assert not stray, f"ranks still running: {stray}"
    resume_line = next(line for line in read_log(log).splitlines() if line.startswith("resume with: "))
    command = shlex.split(resume_line.removeprefix("resume with: "))
    saved = torch.load(command[-1], map_location="cpu", weights_only=False)
    assert 2 <= saved["global_step"] < 8 and saved["tbptt"]["state"][0][0].shape[1] == 16
    resumed = run_app(command[3:], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(tmp_path / "final.pt")["global_step"] == 8


@contextlib.contextmanager
def ddp_fit_with_rank_1_stopped(tmp_path: Path, strategy: list[str]) -> Iterator[tuple[subprocess.Popen, int, Path, float]]:
    """A 2-process gloo fit whose rank 1 is stopped (SIGSTOP) after training step 2: yields rank 0
    (the command), rank 1's pid, the log and when rank 1 was stopped. Afterwards nothing is left:
    rank 1 is continued and killed, rank 0 killed, whatever the test found."""
    marker = tmp_path / "step"
    paced = callbacks_config(tmp_path / "cb.yaml", [("tests.test_runs.Pace", {"delay": 0.3, "marker": str(marker)})])
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", *strategy,
           "--data.init_args.batch_size", "8", "--data.init_args.eval_batch_size", "8"]
    log = tmp_path / "stalled.log"
    process = start_app(["fit", *TINY_SYNTHETIC, *ddp, "--config", str(paced)], tmp_path, log)
    rank_1 = None
    try:
        wait_for(lambda: marker.exists() and marker.read_text() not in ("", "0", "1"), process, log)
        children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 1, children
        rank_1 = int(children[0])
        os.kill(rank_1, signal.SIGSTOP)
        yield process, rank_1, log, time.monotonic()
        stray = subprocess.run(["pgrep", "-f", str(paced)], capture_output=True, text=True).stdout.split()
        assert not stray, f"processes left: {stray}"
    finally:
        if rank_1 is not None:
            for signum in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank_1, signum)
        if process.poll() is None:
            process.kill()
        process.wait()


#: The process-group timeout of the stalled-rank test: long enough for two ranks to start on a
#: loaded two-core machine (the rendezvous is bound by it too), short enough for a test.
TEST_DDP_TIMEOUT = 30


@pytest.mark.slow
def test_a_stopped_rank_ends_a_two_process_ddp_fit_within_the_timeout_with_one_line(tmp_path):
    """Rank 1 stops answering mid-training: rank 0's next collective gives up after the timeout
    set with the strategy class, and the command ends with one line naming rank 1 and the resume
    command (PyTorch's default would have kept it waiting for 30 minutes), leaving no process."""
    strategy = ["--trainer.strategy", "DDPStrategy", "--trainer.strategy.init_args.timeout", f"0:00:{TEST_DDP_TIMEOUT}"]
    with ddp_fit_with_rank_1_stopped(tmp_path, strategy) as (process, rank_1, log, stopped):
        code = process.wait(timeout=TEST_DDP_TIMEOUT + 60)
        waited = time.monotonic() - stopped
        text = read_log(log)
        assert code == 1 and "Traceback" not in text, text[-3000:]
        assert TEST_DDP_TIMEOUT - 5 <= waited <= TEST_DDP_TIMEOUT + 30, waited
        (line,) = [line for line in text.splitlines() if line.startswith("error: ")]
        assert line.startswith(f"error: rank 1 (pid {rank_1}) is stopped (SIGSTOP or a debugger): a DDP collective "
                               f"waited the process-group timeout (0:00:{TEST_DDP_TIMEOUT}) and gave up"), line
        assert "resume with: python -m app fit " in line and line.endswith("--ckpt_path last (a longer wait: "
                                                                          "--trainer.strategy.init_args.timeout, see docs/ddp.md)")
        print(f"\nstalled rank: the run ended {waited:.1f} s after rank 1 stopped, timeout {TEST_DDP_TIMEOUT} s")


@pytest.mark.slow
def test_sigterm_while_a_rank_is_stopped_stops_a_two_process_ddp_fit_at_once(tmp_path):
    """Rank 0 waits in a collective for the stopped rank 1 (with the project's 5-minute timeout):
    Python cannot run the SIGTERM handler in the blocked main thread, so the signal watch stops the
    command ANSWER_WITHIN seconds later with exit code 143, one line and no process left."""
    with ddp_fit_with_rank_1_stopped(tmp_path, ["--trainer.strategy", "ddp"]) as (process, rank_1, log, stopped):
        time.sleep(2)  # rank 0 is in its next collective
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = process.wait(timeout=ANSWER_WITHIN + 60)
        waited = time.monotonic() - signalled
        text = read_log(log)
        assert code == 143 and "Traceback" not in text, text[-3000:]
        assert waited <= ANSWER_WITHIN + 20, waited
        assert (f"interrupted by SIGTERM while waiting for another rank in a DDP collective (rank 1 (pid {rank_1}) is "
                f"stopped (SIGSTOP or a debugger)): stopped at once, without a checkpoint; resume with: python -m app fit ") in text
        print(f"\nSIGTERM during a stalled collective: the command ended {waited:.1f} s after the signal")


def test_a_run_with_a_checkpoint_dirpath_that_fails_mid_training_keeps_its_logs(tmp_path):
    """The run's checkpoints go to an explicit directory, so its version directory holds no
    checkpoint; once a batch was trained, its TensorBoard events and config.yaml are results and
    stay after a one-line error (only a run refused before its first batch gives them back)."""
    failing = callbacks_config(tmp_path / "fail.yaml", [("tests.test_runs.FailAt", {"step": 3})])
    with pytest.raises(ValueError, match="stopped at step 3 on purpose"):
        main(["fit", *TINY_SYNTHETIC, "--trainer.max_epochs", "1", "--checkpoint.dirpath", str(tmp_path / "ckpt"),
              "--config", str(failing), "--trainer.default_root_dir", str(tmp_path),
              "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")])
    run = tmp_path / "runs" / "SyntheticLM-softmax" / "version_0"
    assert (run / "config.yaml").is_file() and list(run.glob("events.out.tfevents.*")), sorted(tmp_path.rglob("*"))


def test_a_run_that_fails_after_taking_the_lock_leaves_no_lock_and_no_empty_directories(tmp_path):
    """The lock is taken before the data is prepared; a missing corpus then fails the run: the
    lock and the directories created for it (version_0/checkpoints) are given back."""
    with pytest.raises(ValueError, match="data directory .* does not exist"):
        main(["fit", "--config", str(ROOT / "configs/lm/ptb.yaml"), "--data.init_args.data_dir", str(tmp_path / "nowhere"),
              "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")])
    assert not list(tmp_path.rglob("run.lock")) and not list(tmp_path.rglob("version_*"))
