"""What a run leaves on disk: checkpoints keep the best ``save_top_k`` on ``val/loss`` plus
``last.ckpt`` (both settable as ``--checkpoint.save_top_k`` / ``--checkpoint.save_last``),
and repeated runs in one log directory get their own ``version_N`` with their own checkpoints
and TensorBoard events, leaving earlier runs' files untouched; a full disk under the log directory
is one line and leaves no half-written logs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.checkpoint_io import read_checkpoint
from app.main import main
from tests.conftest import TinyConfig

ROOT = Path(__file__).resolve().parent.parent

# configs/lm/synthetic.yaml shrunk to a seconds-long run (the shared tiny config); one validation per epoch.
TINY = TinyConfig().args("configs/lm/synthetic.yaml")


def fit(tmp_path: Path, *extra: str):
    return main(["fit", *TINY, *TinyConfig.dirs(tmp_path), *extra])


def digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_repeated_runs_in_one_log_directory_get_their_own_version_checkpoints_and_events(tmp_path):
    first = fit(tmp_path, "--trainer.max_epochs", "1")
    run_dir = Path(first.trainer.logger.log_dir)
    before = digests(run_dir)
    second = fit(tmp_path, "--trainer.max_epochs", "2")
    versions = sorted(p.name for p in run_dir.parent.iterdir())
    assert versions == ["version_0", "version_1"]
    assert digests(run_dir) == before, "the second run changed files of the first"
    for cli, version, epochs in ((first, "version_0", 1), (second, "version_1", 2)):
        log_dir = run_dir.parent / version
        callback = cli.trainer.checkpoint_callback
        # Checkpoints live inside the run's own version directory.
        assert Path(callback.dirpath) == log_dir / "checkpoints"
        assert (log_dir / "checkpoints" / "last.ckpt").is_file() and Path(callback.best_model_path).parent == log_dir / "checkpoints"
        assert read_checkpoint(log_dir / "checkpoints" / "last.ckpt")["epoch"] == epochs - 1
        events = EventAccumulator(str(log_dir))
        events.Reload()
        assert len(events.Scalars("val/loss")) == epochs, f"{version} should hold its own {epochs} validation(s)"
        assert (log_dir / "config.yaml").is_file()


def test_evaluations_log_into_the_run_they_evaluate_and_add_no_training_version(tmp_path):
    """``test`` and ``validate`` of a run's checkpoint log into ``version_N/<command>-<checkpoint>``
    (their metrics readable there; the best and the last checkpoint apart), ``predict`` writes no
    events file at all; a checkpoint from outside a run logs into ``<command>_K``. No evaluation
    takes a ``version_N``, and none warns that the checkpoint callback's directory changed."""
    import warnings

    fit(tmp_path, "--trainer.max_epochs", "1")
    run = tmp_path / "runs" / "SyntheticLM-softmax" / "version_0"
    last = run / "checkpoints" / "last.ckpt"
    evaluate = ["--config", str(ROOT / "configs/lm/synthetic.yaml"), *TinyConfig().shrink("configs/lm/synthetic.yaml", model=False),
                *TinyConfig.dirs(tmp_path)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for command in ("test", "validate", "predict", "test"):
            main([command, *evaluate, "--ckpt_path", str(last)])
    assert not [w for w in caught if "dirpath has changed" in str(w.message) or "Be aware" in str(w.message)], caught
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoints", "predict-last", "test-last", "validate-last"]
    for command, metric, runs in (("test-last", "test/ppl", 2), ("validate-last", "val/ppl", 1)):
        events = EventAccumulator(str(run / command))
        events.Reload()
        assert events.Scalars(metric), command
        assert len(list((run / command).glob("events.out.tfevents.*"))) == runs, command  # one events file per evaluation
    assert not list((run / "predict-last").glob("events.out.tfevents.*"))
    outside = tmp_path / "elsewhere.ckpt"
    outside.write_bytes(last.read_bytes())
    main(["test", *evaluate, "--ckpt_path", str(outside)])
    assert sorted(p.name for p in run.parent.iterdir()) == ["test_0", "version_0"]


@pytest.mark.parametrize("top_k, save_last", [(2, True), (1, False)])
def test_checkpoints_keep_top_k_on_val_loss_plus_last_as_configured(tmp_path, top_k, save_last):
    cli = fit(tmp_path, "--trainer.max_epochs", "3", "--checkpoint.save_top_k", str(top_k),
              "--checkpoint.save_last", str(save_last).lower())
    callback = cli.trainer.checkpoint_callback
    directory = Path(callback.dirpath)
    best = sorted(p.name for p in directory.glob("best-*.ckpt"))
    assert len(best) == top_k, best
    assert (directory / "last.ckpt").is_file() == save_last
    # The kept ones are the lowest validation losses seen, as ModelCheckpoint scored them.
    scores = {Path(path).name: float(score) for path, score in callback.best_k_models.items()}
    assert sorted(scores) == best
    assert min(scores.values()) == pytest.approx(float(callback.best_model_score))


def test_last_checkpoint_follows_the_latest_epoch_when_val_loss_stops_improving(tmp_path):
    """With a zero learning rate val/loss never improves after epoch 0, so only one top-k save
    happens; last.ckpt must still be the latest epoch (Lightning 2.6 alone leaves it at epoch 0)."""
    cli = fit(tmp_path, "--trainer.max_epochs", "3", "--model.init_args.optimizer.init_args.lr", "0.0")
    directory = Path(cli.trainer.checkpoint_callback.dirpath)
    assert [p.name for p in directory.glob("best-*.ckpt")] == ["best-epoch=0-step=2.ckpt"]
    last = read_checkpoint(directory / "last.ckpt")
    assert (last["epoch"], last["global_step"]) == (2, 6)


def test_runs_sharing_an_explicit_checkpoint_dirpath_do_not_overwrite_each_other(tmp_path):
    shared = tmp_path / "ckpts"
    fit(tmp_path, "--trainer.max_epochs", "1", "--checkpoint.dirpath", str(shared))
    before = digests(shared)
    second = fit(tmp_path, "--trainer.max_epochs", "1", "--checkpoint.dirpath", str(shared))
    after = digests(shared)
    assert {k: after[k] for k in before} == before, "the second run overwrote the first run's checkpoints"
    # Lightning's version counter gives the second run's files a -v1 suffix.
    assert Path(second.trainer.checkpoint_callback.last_model_path).name == "last-v1.ckpt"
    assert len(after) == 2 * len(before)


def test_a_failed_run_leaves_no_empty_version_directory(tmp_path):
    """The version directory is claimed early (see the concurrency test) and given back when
    the run fails before writing to it."""
    with pytest.raises(ValueError, match="unknown head 'nope'"):
        fit(tmp_path, "--trainer.max_epochs", "1", "--model.init_args.head", "nope")
    assert not list((tmp_path / "runs").rglob("version_*"))


@pytest.mark.slow
def test_runs_started_together_in_one_log_directory_get_distinct_versions(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "app", "fit", *TINY, "--trainer.max_epochs", "1",
               "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    runs = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for run in runs:
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-2000:]
    versions = sorted((tmp_path / "runs").glob("*/version_*"))
    assert [v.name for v in versions] == ["version_0", "version_1"]
    for version in versions:
        assert len(list(version.glob("events.out.tfevents.*"))) == 1, f"{version} holds another run's events"
        assert (version / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow  # a file-size limit on a process of its own
@pytest.mark.parametrize("limit, failing", [(60, "the events file's first record"), (2000, "config.yaml")])
def test_a_full_disk_under_the_log_directory_is_one_line_and_leaves_no_empty_logs(tmp_path, limit, failing):
    """The run may write files of at most ``limit`` bytes (RLIMIT_FSIZE; writes past it fail with
    EFBIG as they fail with ENOSPC on a full disk): first ``failing`` cannot be written, in
    TensorBoard's writer thread or in the run's own. Before: OSError tracebacks and the run's
    partial logs left behind. After: one line naming the log directory, nothing left behind."""
    import resource
    import signal

    from tests.shell import one_error_line, run_app

    def file_size_limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    runs = tmp_path / "runs"
    result = run_app(["fit", *TINY, *TinyConfig.dirs(tmp_path)], tmp_path, preexec_fn=file_size_limit)
    assert "Exception in thread" not in result.stderr, result.stderr[-3000:]
    assert one_error_line(result) == (
        f"error: cannot write the run's logs in {runs}/SyntheticLM-softmax/version_0: File too large; the run stopped "
        f"and nothing of this run is kept; free space on that disk or pass another --trainer.logger.init_args.save_dir")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [], "the refused run left files behind"


def test_a_run_stopped_by_a_full_disk_after_it_started_keeps_its_data_but_no_empty_log_file(tmp_path):
    """The later case of the test above (the disk fills mid-run): the empty files the failed writes
    created go, the logs that hold data and every other file stay, and the line says so."""
    import errno

    from app.runtime.directories import STARTED, disk_full_line, remove_empty_logs

    (tmp_path / "events.out.tfevents.1.vm.1.0").write_bytes(b"")
    (tmp_path / "hparams.yaml").write_bytes(b"")
    (tmp_path / "config.yaml").write_text("trainer: {}\n")
    (tmp_path / "notes.txt").write_bytes(b"")  # not a log: the user's
    remove_empty_logs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "notes.txt"]
    STARTED.append(True)
    try:
        line = disk_full_line(OSError(errno.ENOSPC, "No space left on device"), str(tmp_path))
    finally:
        STARTED.clear()
    assert line == (f"cannot write the run's logs in {tmp_path}: No space left on device; the run stopped and its logs "
                    f"and checkpoints so far are kept; free space on that disk or pass another "
                    f"--trainer.logger.init_args.save_dir")
