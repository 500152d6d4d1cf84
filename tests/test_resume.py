"""Exact resume after a SIGKILL, checkpoints that survive a kill mid-write, and the NaN guard.

What is proved, on the real CLI and the real synthetic LM config shrunk to seconds:

* a run SIGKILLed in the middle of an epoch and resumed with ``--ckpt_path last`` ends with the
  same parameters and final validation loss as the same run left alone. That needs the TBPTT
  stream position (``datamodules/lm_stream.py: StreamLoader`` state in the checkpoint), the
  carried LSTM state and the RNG state (``tasks/language_model.py: on_save_checkpoint``);
  dropout is switched on so the RNG state matters;
* a process killed while it writes a checkpoint leaves the previous one loadable
  (``app/checkpoint_io/writing.py``);
* a non-finite loss stops training without overwriting the last good checkpoint.

Deterministic CPU settings: one thread (``OMP_NUM_THREADS=1``) and the CLI's
``seed_everything: 0``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from app.checkpoint_io import AtomicCheckpointIO
from app.main import main
from datamodules.hierarchy import HierarchyDataModule
from tests.conftest import TinyConfig
from tests.shell import run_app, run_cli

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = ROOT / "configs/lm/synthetic.yaml"

#: configs/lm/synthetic.yaml shrunk: 8 windows of 16 x 35 tokens per epoch, a 2 x 24 LSTM,
#: dropout on (so the resumed RNG state matters), a checkpoint every 3 steps.
TINY_SYNTHETIC = [
    "--config", str(SYNTHETIC),
    "--data.init_args.train_tokens", "4000", "--data.init_args.valid_tokens", "600",
    "--data.init_args.test_tokens", "600", "--data.init_args.vocab_size", "60",
    "--model.init_args.encoder.init_args.hidden_size", "24", "--model.init_args.encoder.init_args.last_hidden_size", "16",
    "--model.init_args.encoder.init_args.dropout_output", "0.2", "--model.init_args.encoder.init_args.weight_drop", "0.2",
    "--model.init_args.eval_topk", "[1]",
    "--trainer.max_epochs", "2", "--trainer.limit_val_batches", "3",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    "--trainer.log_every_n_steps", "1",
]


class RecordFinal(pl.Callback):
    """Writes the final parameters and validation loss of a run to ``path`` (rank 0)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            params = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
            torch.save({"params": params, "val_loss": float(trainer.callback_metrics["val/loss"]),
                        "global_step": trainer.global_step}, self.path)


class KillAt(pl.Callback):
    """SIGKILLs its own process right after optimisation step ``step`` (no cleanup, no flush):
    a deterministic stand-in for a scheduler's or the OOM killer's kill. Lightning runs
    ModelCheckpoint after other callbacks, so a checkpoint due at this step is not written."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def callbacks_config(path: Path, callbacks: list[tuple[str, dict[str, Any]]]) -> Path:
    """A YAML config adding test callbacks (``class_path`` + ``init_args``) to the trainer."""
    lines = ["trainer:", "  callbacks:"]
    for class_path, init_args in callbacks:
        args = ", ".join(f"{k}: {v!r}" for k, v in init_args.items())
        lines += [f"    - class_path: {class_path}", f"      init_args: {{{args}}}"]
    path.write_text("\n".join(lines) + "\n")
    return path




def run_dirs(directory: Path) -> list[str]:
    """The shared run directories, and a checkpoint every 3 steps in ``directory/ckpt``."""
    return [*TinyConfig.dirs(directory), "--checkpoint.dirpath", str(directory / "ckpt"), "--checkpoint.every_n_train_steps", "3"]


def loader_position(state: dict[str, Any]) -> tuple[int, int]:
    """``(epoch, batches handed out)`` in a training ``StatefulDataLoader``'s checkpointed state (the
    sampler's for map-style data, the token stream's for translation; single-process loaders)."""
    if state["dataset_state"] is not None:
        return state["dataset_state"]["epoch"], state["dataset_state"]["batches_done"]
    return state["_sampler_iter_state"]["sampler_state"]["epoch"], state["_num_yielded"]


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys()
    worst = max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12), k) for k in a)
    return float(worst[0]), worst[1]


def assert_resumed_equals(resumed: dict[str, Any], straight: dict[str, Any], what: str = "run") -> float:
    """Same parameters (<= 1e-6 relative) and final val/loss as the uninterrupted ``what``; returns the
    largest parameter difference (printed by the callers for docs/results/reliability.md)."""
    diff, name = max_relative_difference(resumed["params"], straight["params"])
    assert diff <= 1e-6, f"resumed parameters differ from the uninterrupted {what}: {name} relative {diff:.3g}"
    assert resumed["val_loss"] == pytest.approx(straight["val_loss"], rel=1e-6, abs=0)
    return diff


@pytest.fixture(scope="module")
def uninterrupted_tiny_run(tmp_path_factory) -> dict[str, Any]:
    """Final parameters and val/loss of the tiny synthetic run left alone (shared by the
    resume tests that kill the same configuration at different points)."""
    straight = tmp_path_factory.mktemp("straight")
    record = "tests.test_resume.RecordFinal"
    # In this process (one thread, see conftest.py): saves an interpreter start.
    main(["fit", *TINY_SYNTHETIC, *run_dirs(straight), "--config",
          str(callbacks_config(straight / "cb.yaml", [(record, {"path": str(straight / "final.pt")})]))])
    return torch.load(straight / "final.pt")


def kill_and_resume(broken: Path, args: list[str], kill_step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``fit args`` SIGKILLed after optimisation step ``kill_step``, then resume it with
    ``--ckpt_path last``; returns the killed run's last checkpoint and the resumed run's record."""
    record = "tests.test_resume.RecordFinal"
    killed = run_app(["fit", *args, "--config", str(callbacks_config(
        broken / "kill.yaml", [("tests.test_resume.KillAt", {"step": kill_step})]))], broken)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = torch.load(broken / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    resumed = run_cli(["fit", *args, "--ckpt_path", "last", "--config",
                       str(callbacks_config(broken / "cb.yaml", [(record, {"path": str(broken / "final.pt")})]))], broken)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not resumable" not in resumed.stderr, "Lightning must see a resumable train loader"
    return saved, torch.load(broken / "final.pt")


@pytest.mark.slow  # kill -9 of a process of its own
def test_sigkill_mid_epoch_then_resume_matches_uninterrupted_run(tmp_path, uninterrupted_tiny_run):
    """16 steps (2 epochs of 8 windows), checkpoints every 3 steps. The interrupted run is
    killed after step 11 (epoch 1, window 3); its last checkpoint is from step 9 (epoch 1,
    after window 1), so the resumed run must continue the stream at window 2 of epoch 1 with
    the carried LSTM state and RNG state of step 9, and redo steps 10-11."""
    broken = tmp_path / "broken"
    broken.mkdir()
    record = "tests.test_resume.RecordFinal"
    killed = run_app(["fit", *TINY_SYNTHETIC, *run_dirs(broken), "--config",
                      str(callbacks_config(broken / "kill.yaml", [("tests.test_resume.KillAt", {"step": 11})]))], broken)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    last = broken / "ckpt" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 9, "the kill must land after the step-9 checkpoint and before the next one"
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 1, "windows_done": 1}]
    assert saved["tbptt"]["windows_done"] == 1 and saved["tbptt"]["state"] is not None

    resumed = run_cli(["fit", *TINY_SYNTHETIC, *run_dirs(broken), "--ckpt_path", "last", "--config",
                       str(callbacks_config(broken / "cb.yaml", [(record, {"path": str(broken / "final.pt")})]))], broken)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not resumable" not in resumed.stderr, "Lightning must see a resumable train loader"

    a, b = torch.load(broken / "final.pt"), uninterrupted_tiny_run
    assert a["global_step"] == b["global_step"] == 16
    diff = assert_resumed_equals(a, b)
    # Shown with pytest -s; docs/results/reliability.md records these figures.
    print(f"largest parameter relative difference {diff:.3g}; final val/loss resumed {a['val_loss']!r}, "
          f"uninterrupted {b['val_loss']!r}")


@pytest.mark.slow  # kill -9 of a process of its own
def test_sigkill_after_an_end_of_epoch_checkpoint_then_resume_matches_uninterrupted_run(tmp_path, uninterrupted_tiny_run):
    """The same run killed after step 9, the first window of epoch 1, before its step checkpoint:
    last.ckpt is the one Lightning writes at the end of epoch 0 (step 8, after validation). The
    resumed run starts epoch 1 with a fresh LSTM state, as the uninterrupted run does, and must
    draw the same dropout masks: the checkpoint's RNG state is put back at window 0 of epoch 1
    (it used to be restored only mid-epoch; the resumed run then drew from the RNG state of a
    freshly seeded process)."""
    # Checkpoints at epoch ends only (Lightning's default; a checkpoint does not change training,
    # so the uninterrupted run with step checkpoints is the same run).
    epoch_ends = ["--checkpoint.every_n_train_steps", "null", "--checkpoint.every_n_epochs", "1"]
    saved, resumed = kill_and_resume(tmp_path, [*TINY_SYNTHETIC, *run_dirs(tmp_path), *epoch_ends], kill_step=9)
    assert saved["global_step"] == 8 and saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"epoch": 0, "windows_done": 8}]
    assert saved["tbptt"]["epoch_complete"] and saved["tbptt"]["windows_done"] == 8
    straight = uninterrupted_tiny_run
    assert resumed["global_step"] == straight["global_step"] == 16
    diff = assert_resumed_equals(resumed, straight)
    print(f"end-of-epoch resume: largest parameter relative difference {diff:.3g}; final val/loss resumed "
          f"{resumed['val_loss']!r}, uninterrupted {straight['val_loss']!r}")


@pytest.mark.slow
def test_two_process_ddp_sigkill_then_resume_matches_uninterrupted_ddp_run(tmp_path):
    """The same kill-at-step-11 / resume-from-step-9 schedule with 2 gloo processes x 8 rows
    (16 global rows, as above). Both ranks are SIGKILLed; the checkpoint must carry both ranks'
    LSTM states (gathered into 16 global rows) for the resumed run to match."""
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
           "--data.init_args.batch_size", "8", "--data.init_args.eval_batch_size", "8"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    for d in (straight, broken):
        d.mkdir()
    record = "tests.test_resume.RecordFinal"
    done = run_app(["fit", *TINY_SYNTHETIC, *ddp, *run_dirs(straight), "--config",
                    str(callbacks_config(straight / "cb.yaml", [(record, {"path": str(straight / "final.pt")})]))], straight)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = run_app(["fit", *TINY_SYNTHETIC, *ddp, *run_dirs(broken), "--config",
                      str(callbacks_config(broken / "kill.yaml", [("tests.test_resume.KillAt", {"step": 11})]))], broken)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = torch.load(broken / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 9 and saved["tbptt"]["state"][0][0].shape[1] == 16
    resumed = run_app(["fit", *TINY_SYNTHETIC, *ddp, *run_dirs(broken), "--ckpt_path", "last", "--config",
                       str(callbacks_config(broken / "cb.yaml", [(record, {"path": str(broken / "final.pt")})]))], broken)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = torch.load(broken / "final.pt"), torch.load(straight / "final.pt")
    assert a["global_step"] == b["global_step"] == 16
    assert_resumed_equals(a, b, "DDP run")


# ------------------------------------------------------------------ kill while writing
#: Fault injection in a child process: SIGKILL (a) after the first MB of the new checkpoint's
#: bytes reached the file, or (b) once every byte is written but before the rename commits it.
KILL_WHILE_WRITING = """
import builtins, os, signal, sys, torch
from app.checkpoint_io import AtomicCheckpointIO

path, when = sys.argv[1], sys.argv[2]
real_open, real_fsync = builtins.open, os.fsync

class KillAfterBytes:
    def __init__(self, handle):
        self.handle, self.written = handle, 0
    def write(self, data):
        self.handle.write(data)
        self.handle.flush()
        self.written += len(data)
        if self.written > 1 << 20:
            os.kill(os.getpid(), signal.SIGKILL)
        return len(data)
    def __getattr__(self, name):
        return getattr(self.handle, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.handle.close()

def open_temporary_killing(file, mode="r", *args, **kwargs):
    handle = real_open(file, mode, *args, **kwargs)
    temporary = "w" in mode and os.path.basename(os.fspath(file)).startswith(".tmp-")
    return KillAfterBytes(handle) if temporary else handle

if when == "mid-bytes":
    builtins.open = open_temporary_killing
else:
    def fsync_then_die(fd):
        real_fsync(fd)
        os.kill(os.getpid(), signal.SIGKILL)
    os.fsync = fsync_then_die
# 64 tensors of 256 KB: torch.save writes them one after the other.
AtomicCheckpointIO().save_checkpoint({"state_dict": {f"w{i}": torch.randn(1 << 16) for i in range(64)}}, path)
"""


@pytest.mark.slow  # kill -9 of a process of its own
@pytest.mark.parametrize("when", ["mid-bytes", "before-rename"])
def test_kill_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, when):
    path = tmp_path / "last.ckpt"
    previous = {"state_dict": {"w": torch.arange(5.0)}, "global_step": 7, "pytorch-lightning_version": "2.6.0"}
    AtomicCheckpointIO().save_checkpoint(previous, path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", KILL_WHILE_WRITING, str(path), when], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    # The kill left the new checkpoint's bytes in a temporary file (so it did die while
    # writing) but the final path still holds the complete previous checkpoint.
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 1 << 20
    loaded = AtomicCheckpointIO().load_checkpoint(path)
    assert loaded["global_step"] == 7 and torch.equal(loaded["state_dict"]["w"], torch.arange(5.0))


def test_atomic_checkpoint_io_replaces_and_leaves_no_temporaries(tmp_path):
    path = tmp_path / "sub" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {}, "step": 1}, path)  # the reader wants a training checkpoint
    io.save_checkpoint({"state_dict": {}, "step": 2}, path)
    assert io.load_checkpoint(path)["step"] == 2
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_cli_uses_the_atomic_checkpoint_writer(tmp_path):
    cli = main([*TINY_SYNTHETIC, *run_dirs(tmp_path), "--trainer.max_epochs", "1",
                "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1"], run=False)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)


def test_resume_with_a_different_global_batch_is_refused():
    from functools import partial

    from tasks.encoders import AWDLSTMEncoder
    from tasks.language_model import LanguageModel

    model = LanguageModel(num_classes=12, encoder=partial(AWDLSTMEncoder, embedding_dim=4, hidden_size=6, num_layers=1))
    state = [(torch.zeros(1, 4, 4), torch.zeros(1, 4, 4))]
    model._resume_state = {"epoch": 0, "windows_done": 3, "state": state, "rng_state": torch.get_rng_state()}
    with pytest.raises(ValueError, match=r"4 global rows but this run has 1 process\(es\) x batch_size 2 = 2 "
                                         r"\(resume with devices \* data.init_args.batch_size = 4\)"):
        model._restore_train_state(batch_idx=3, batch_rows=2)


# ------------------------------------------------------------------ non-finite loss guard
class PoisonAt(pl.Callback):
    """After optimisation step ``step``, sets the head's biases to NaN: the next loss is NaN, as
    after a divergence. (Lightning runs ModelCheckpoint after this callback.)"""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                for name, parameter in pl_module.head.named_parameters():
                    if name.endswith("bias"):
                        parameter.fill_(float("nan"))


def test_non_finite_loss_stops_before_overwriting_the_last_good_checkpoint(tmp_path):
    """Checkpoints every 3 steps (Lightning defers the ones before the first validation, so the
    first is at step 9, epoch 1); the model is poisoned after step 11, so step 12's loss is NaN.
    The guard raises inside step 12's training_step, before the step-12 checkpoint would have
    replaced last.ckpt with NaN weights: last.ckpt stays the finite step-9 checkpoint."""
    poison = callbacks_config(tmp_path / "poison.yaml", [("tests.test_resume.PoisonAt", {"step": 11})])
    with pytest.raises(FloatingPointError, match=r"non-finite training loss nan at global step 11, epoch 1, batch 3; "
                                                 r"head Softmax stats .*; learning rate 0.01; no checkpoint was written "
                                                 r"from this step: lower the learning rate"):
        main(["fit", *TINY_SYNTHETIC, *run_dirs(tmp_path), "--config", str(poison)])
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 9
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values() if v.is_floating_point())


# ------------------------------------------------------------------ stream position
@pytest.mark.parametrize("num_workers", [0, 1])
def test_stream_loader_state_resumes_at_the_next_window(num_workers):
    from datamodules.lm_stream import StreamLoader, TBPTTStream

    tokens = torch.arange(200)
    uninterrupted = StreamLoader(TBPTTStream(tokens, 3, 7, variable_length=True, seed=4), num_workers)
    epoch0 = list(uninterrupted)
    epoch1 = list(uninterrupted)
    first = StreamLoader(TBPTTStream(tokens, 3, 7, variable_length=True, seed=4), num_workers)
    list(first)  # epoch 0
    iterator = iter(first)
    for _ in range(2):
        next(iterator)
    state = first.state_dict()
    assert state == {"epoch": 1, "windows_done": 2}
    resumed = StreamLoader(TBPTTStream(tokens, 3, 7, variable_length=True, seed=4), num_workers)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(epoch1) - 2 and all(torch.equal(a["input"], b["input"]) for a, b in zip(rest, epoch1[2:]))
    # A state at the end of an epoch continues with the next epoch from its first window.
    done = StreamLoader(TBPTTStream(tokens, 3, 7, variable_length=True, seed=4), num_workers)
    done.load_state_dict({"epoch": 0, "windows_done": len(epoch0)})
    assert [b["input"].shape for b in done] == [b["input"].shape for b in epoch1]


# ------------------------------------------------------------------ mid-epoch validation
@pytest.mark.slow  # kill -9 of a process of its own
@pytest.mark.parametrize("kill_step, last_step", [(5, 4), (7, 6)])
def test_sigkill_after_a_mid_epoch_validation_then_resume_matches_uninterrupted_run(tmp_path, kill_step, last_step):
    """One epoch of 8 windows validated every 4 steps (``val_check_interval 4``: at steps 4 and 8)
    with step checkpoints every 3 steps. Killed after step 5, the last checkpoint is the one
    written right after the mid-epoch validation of step 4 (Lightning saves on validation end
    when it validates inside an epoch); killed after step 7, it is the step-6 checkpoint, which
    follows that validation. The resumed run must continue the stream, LSTM state and RNG of
    that step and end with the uninterrupted run's parameters and final val/loss."""
    args = [*TINY_SYNTHETIC, "--trainer.max_epochs", "1", "--trainer.val_check_interval", "4"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    for d in (straight, broken):
        d.mkdir()
    main(["fit", *args, *run_dirs(straight), "--config", str(callbacks_config(
        straight / "cb.yaml", [("tests.test_resume.RecordFinal", {"path": str(straight / "final.pt")})]))])
    saved, resumed = kill_and_resume(broken, [*args, *run_dirs(broken)], kill_step=kill_step)
    assert saved["global_step"] == last_step
    assert saved["tbptt"]["windows_done"] == last_step and saved["tbptt"]["state"] is not None
    uninterrupted = torch.load(straight / "final.pt")
    assert resumed["global_step"] == uninterrupted["global_step"] == 8
    diff = assert_resumed_equals(resumed, uninterrupted)
    print(f"resume after a mid-epoch validation (kill after step {kill_step}, checkpoint of step {last_step}): "
          f"largest parameter relative difference {diff:.3g}; final val/loss resumed {resumed['val_loss']!r}, "
          f"uninterrupted {uninterrupted['val_loss']!r}")


# ------------------------------------------------------------------ mid-epoch resume of the other tasks
#: Tiny configurations of the map-style and token-batch tasks (6-8 batches per epoch, 2 epochs,
#: dropout on), the step their run is killed after, and the step of its last checkpoint (step
#: checkpoints every 3 steps wait for the first validation: they monitor val/loss).
MID_EPOCH_TASKS = {
    "captioning": ([
        "--config", str(ROOT / "configs/captioning/synthetic.yaml"), "--data.init_args.num_train", "24",
        "--data.init_args.num_val", "6", "--data.init_args.num_test", "6", "--data.init_args.image_size", "32",
        "--data.init_args.batch_size", "4", "--data.init_args.captions_per_image", "2",
        "--model.init_args.decoder.init_args.embed_dim", "16", "--model.init_args.decoder.init_args.hidden_size", "16",
        "--model.init_args.decoder.init_args.dropout", "0.3", "--model.init_args.meteor", "false", "--model.init_args.metric_tokenizer", "simple",
    ], 10, 9),
    "hanzi": ([
        "--config", str(ROOT / "configs/hanzi/font_rendered.yaml"), "--data.init_args.image_size", "24",
        "--data.init_args.num_classes_limit", "8", "--data.init_args.train_writers", "4", "--data.init_args.batch_size", "16",
        "--model.init_args.encoder.init_args.channels", "[8, 16, 16]",
        "--model.init_args.encoder.init_args.out_features", "16", "--model.init_args.encoder.init_args.dropout", "0.3",
    ], 10, 9),
    "translation": ([
        "--config", str(ROOT / "configs/translation/synthetic_lstm.yaml"), "--data.init_args.synthetic_size", "200",
        "--data.init_args.max_tokens", "60", "--model.init_args.network.init_args.embed_dim", "16",
        "--model.init_args.network.init_args.hidden_size", "16", "--model.init_args.network.init_args.dropout", "0.3",
        "--model.init_args.val_bleu_sentences", "4",
        "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "2",
    ], 10, 9),
}


@pytest.mark.slow  # kill -9 of a process of its own
@pytest.mark.parametrize("task", ["hanzi", "captioning", "translation"])
def test_sigkill_mid_epoch_then_resume_matches_uninterrupted_run_for_other_tasks(tmp_path, task):
    """A run killed in its second epoch resumes from the mid-epoch checkpoint before the kill
    (``datamodules/resumable.py``: the epoch's order after the batches already trained, and the
    random state of the save) and ends with the uninterrupted run's parameters and val/loss."""
    settings, kill_step, last_step = MID_EPOCH_TASKS[task]
    per_task = [*settings, "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false",
                "--trainer.enable_model_summary", "false"]  # after the task's --config, which sets its own
    if task in ("hanzi", "translation"):  # a cache of rendered images / tokenised corpus for both runs
        per_task += ["--data.init_args.cache_dir", str(tmp_path / "cache")]
    if task == "translation":
        per_task += ["--data.init_args.data_dir", str(tmp_path / "syn")]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    for d in (straight, broken):
        d.mkdir()
    main(["fit", *per_task, *run_dirs(straight), "--config", str(callbacks_config(
        straight / "cb.yaml", [("tests.test_resume.RecordFinal", {"path": str(straight / "final.pt")})]))])
    saved, resumed = kill_and_resume(broken, [*per_task, *run_dirs(broken)], kill_step=kill_step)
    assert saved["global_step"] == last_step
    state = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    uninterrupted = torch.load(straight / "final.pt")
    steps_per_epoch = uninterrupted["global_step"] // 2
    assert loader_position(state) == (1, last_step - steps_per_epoch) and last_step > steps_per_epoch
    assert resumed["global_step"] == uninterrupted["global_step"]
    diff = assert_resumed_equals(resumed, uninterrupted, f"{task} run")
    print(f"{task} mid-epoch resume: largest parameter relative difference {diff:.3g}; final val/loss resumed "
          f"{resumed['val_loss']!r}, uninterrupted {uninterrupted['val_loss']!r}")


# ------------------------------------------------------------------ resumable loaders
def resumable(dataset, rank: int = 0, world_size: int = 1, batch_size: int = 3):
    from datamodules.resumable import ResumableSampler, training_loader

    return training_loader(dataset, sampler=ResumableSampler(dataset, world_size, rank, seed=5), batch_size=batch_size)


def fake_trainer(loader, world_size: int = 1, global_step: int = 6, ckpt_path: str | None = "mid.ckpt"):
    """The trainer attributes ``datamodules/resumable.py`` reads: fitting, resumed ``global_step``
    steps into a run of 10 batches per epoch."""
    from types import SimpleNamespace

    return SimpleNamespace(state=SimpleNamespace(fn="fit"), world_size=world_size, train_dataloader=loader,
                           ckpt_path=ckpt_path, num_training_batches=10, accumulate_grad_batches=1,
                           global_step=global_step, current_epoch=global_step // 10)


@pytest.mark.parametrize("world_size", [1, 2])
def test_resumable_loader_continues_after_the_batches_served_on_every_rank(world_size):
    """Each rank's loader, rebuilt from a state taken 2 batches into epoch 1, yields the rest of
    that epoch's batches (the same shuffled share of the same permutation) without loading the
    skipped samples."""
    dataset = torch.arange(40.0)
    for rank in range(world_size):
        uninterrupted = resumable(dataset, rank, world_size)
        uninterrupted.sampler.set_epoch(1)
        epoch1 = list(uninterrupted)
        first = resumable(dataset, rank, world_size)
        first.sampler.set_epoch(1)
        iterator = iter(first)
        served = [next(iterator), next(iterator)]
        state = first.state_dict()
        loaded: list[int] = []
        resumed = resumable(Recording(dataset, loaded), rank, world_size)
        resumed.load_state_dict(state)
        resumed.sampler.set_epoch(1)
        rest = list(resumed)
        assert torch.equal(torch.cat(served + rest), torch.cat(epoch1))
        assert len(loaded) == len(torch.cat(rest)), "the skipped samples must not be loaded"


class Recording(torch.utils.data.Dataset):
    """``dataset``, recording every index it loads in ``loaded``."""

    def __init__(self, dataset, loaded: list[int]) -> None:
        self.dataset, self.loaded = dataset, loaded

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        self.loaded.append(index)
        return self.dataset[index]


def test_the_random_state_of_the_save_comes_back_before_the_first_batch():
    """``TrainingRandomState`` keeps the global random state of the save and puts it back when
    training starts, mid-epoch and after an end-of-epoch checkpoint alike."""
    from datamodules.resumable import TrainingRandomState

    loader = resumable(torch.arange(40.0))
    for global_step in (6, 10):
        saving = TrainingRandomState()
        saving.setup(fake_trainer(loader, global_step=global_step), None, "fit")
        state = saving.state_dict()
        expected_draw = torch.rand(3)  # what the next step would draw after the save
        torch.rand(7)  # a fresh process draws from elsewhere
        resumed = TrainingRandomState()
        resumed.load_state_dict(state)
        resumed.on_train_start(fake_trainer(resumable(torch.arange(40.0)), global_step=global_step), None)
        assert torch.equal(torch.rand(3), expected_draw)


def test_an_end_of_epoch_position_starts_the_next_epoch_from_its_first_batch():
    dataset = torch.arange(40.0)
    done = resumable(dataset)
    list(done)  # epoch 0
    resumed = resumable(dataset)
    resumed.load_state_dict(done.state_dict())
    resumed.sampler.set_epoch(1)
    whole = resumable(dataset)
    whole.sampler.set_epoch(1)
    assert torch.equal(torch.cat(list(resumed)), torch.cat(list(whole)))


def test_resumable_loader_needs_the_same_global_batch_mid_epoch():
    """2 x 4 and 1 x 8 cover the same permutation positions per step: one continues the other;
    1 x 4 would start elsewhere and is refused."""
    from datamodules.resumable import TrainingRandomState

    dataset = torch.arange(40.0)
    ranks = [resumable(dataset, rank, 2, batch_size=4) for rank in range(2)]
    for loader in ranks:
        loader.sampler.set_epoch(1)
    iterators = [iter(loader) for loader in ranks]
    served = [next(it) for it in iterators for _ in range(2)]
    saving = TrainingRandomState()
    saving.setup(fake_trainer(ranks[0], world_size=2, global_step=12), None, "fit")
    saved = saving.state_dict()

    one = resumable(dataset, batch_size=8)
    one.load_state_dict(ranks[0].state_dict())
    resumed = TrainingRandomState()
    resumed.load_state_dict(saved)
    resumed.on_train_start(fake_trainer(one, global_step=12), None)
    one.sampler.set_epoch(1)
    whole = resumable(dataset, batch_size=8)
    whole.sampler.set_epoch(1)
    assert torch.equal(torch.cat(served).sort().values, torch.cat(list(whole)[:2]).sort().values)
    assert torch.equal(torch.cat(list(one)), torch.cat(list(whole)[2:]))

    smaller = resumable(dataset, batch_size=4)
    smaller.load_state_dict(ranks[0].state_dict())
    refused = TrainingRandomState()
    refused.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"^checkpoint was written in the middle of epoch 1 by 2 process\(es\) x batch_size 4 "
                                         r"= 8 samples per step but this run has 1 x 4 = 4: its position in the epoch "
                                         r"means other samples here \(resume with devices \* data.init_args.batch_size = 8, "
                                         r"or from an end-of-epoch checkpoint\)$"):
        refused.on_train_start(fake_trainer(smaller, global_step=12), None)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_token_batches_resume_after_the_trained_ones(num_workers):
    """Translation's token batches: a loader rebuilt from a state taken 3 batches into epoch 3
    yields the rest of that epoch, and a state taken from it counts those 3 too; a state from the
    end of an epoch starts the next one from its first batch."""
    from datamodules.resumable import training_loader
    from datamodules.translation.batching import Example, TokenBatchStream

    examples = [Example(i, [5] * (1 + i % 7), [6] * (1 + i % 5), "", "") for i in range(60)]
    epoch = {"now": 3}

    def loader():
        stream = TokenBatchStream(examples, 40, None, shuffle=True, seed=0, rank=0, world_size=1, even=True,
                                  epoch_fn=lambda: epoch["now"])
        return training_loader(stream, batch_size=None, num_workers=num_workers)

    def ids(batches) -> list[list[int]]:
        return [batch["index"].tolist() for batch in batches]

    epoch3 = ids(loader())
    assert len(epoch3) >= 6
    first = loader()
    iterator = iter(first)
    served = ids(next(iterator) for _ in range(3))
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    iterator = iter(resumed)
    assert served + ids([next(iterator)]) == epoch3[:4]
    again = loader()
    again.load_state_dict(resumed.state_dict())
    assert ids(list(again)) == epoch3[4:]

    done = loader()
    list(done)
    epoch["now"] = 4
    following = loader()
    following.load_state_dict(done.state_dict())
    assert ids(following) == ids(loader())


@pytest.mark.parametrize("checkpoint", ["mid-epoch", "end-of-epoch"])
def test_a_resumed_hierarchy_run_ends_with_the_uninterrupted_runs_parameters(tmp_path, checkpoint):
    """In one process, on Lightning's own resume: a run of 2 epochs of 10 batches (dropout on)
    checkpointed after step 13 (epoch 1, batch 3) or at the end of epoch 0, resumed from that
    checkpoint by a new trainer, ends with the parameters of the run that wrote it."""
    from tasks.classification import ClassificationTask
    from tasks.encoders import MLPEncoder

    sizes = dict(num_super=4, num_sub=5, train_per_class=8, val_per_class=1, test_per_class=1, batch_size=16)

    def fit(callbacks, ckpt_path=None) -> dict[str, torch.Tensor]:
        pl.seed_everything(0)
        model = ClassificationTask(num_classes=20, encoder=MLPEncoder(32, [16], dropout=0.3), eval_topk=(1,), predict_topk=1)
        trainer = pl.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=callbacks, enable_checkpointing=bool(callbacks))
        trainer.fit(model, HierarchyDataModule(**sizes), ckpt_path=ckpt_path)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    every = {"every_n_train_steps": 13} if checkpoint == "mid-epoch" else {"every_n_epochs": 1}
    straight = fit([pl.callbacks.ModelCheckpoint(tmp_path, "{step}", save_top_k=-1, **every)])
    path = tmp_path / ("step=13.ckpt" if checkpoint == "mid-epoch" else "step=10.ckpt")
    torch.rand(5)  # the resumed run must not depend on the random state it starts with
    resumed = fit([], ckpt_path=str(path))
    diff, name = max_relative_difference(resumed, straight)
    assert diff == 0, f"resumed parameters differ from the uninterrupted run: {name} relative {diff:.3g}"


class PlainLoaderHierarchy(HierarchyDataModule):
    """The hierarchy with a train loader that cannot resume mid-epoch (a plain DataLoader)."""

    def train_dataloader(self):
        from torch.utils.data import DataLoader

        from datamodules.sharding import training_sampler

        self.setup()
        return DataLoader(self.splits["train"], sampler=training_sampler(self.splits["train"], 0, 1),
                          batch_size=self.hparams.batch_size)


def test_a_mid_epoch_checkpoint_is_refused_when_the_train_loader_cannot_resume(tmp_path):
    """Lightning itself would only warn and restart the epoch's order from its first batch. (On
    the Python API: the CLI refuses a checkpoint naming a datamodule outside the project's
    packages before it gets this far, and every project datamodule's train loader resumes.)"""
    from tasks.classification import ClassificationTask
    from tasks.encoders import MLPEncoder

    def fit(data, **kwargs) -> pl.Trainer:
        model = ClassificationTask(num_classes=20, encoder=MLPEncoder(32, [16]), eval_topk=(1,), predict_topk=1)
        settings = {"enable_checkpointing": False, **kwargs.pop("trainer", {})}
        trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, **settings)
        trainer.fit(model, data, **kwargs)
        return trainer

    sizes = dict(num_super=4, num_sub=5, train_per_class=8, val_per_class=1, test_per_class=1, batch_size=16)
    # A checkpoint after step 6 of an epoch of 10 batches, without a loader position.
    fit(PlainLoaderHierarchy(**sizes), trainer={"callbacks": [pl.callbacks.ModelCheckpoint(
        tmp_path, "mid", every_n_train_steps=6, save_top_k=1)], "enable_checkpointing": True})
    path = tmp_path / "mid.ckpt"
    with pytest.raises(ValueError, match=(
            rf"^checkpoint {path} was written in the middle of epoch 0 \(global step 6\) but the training loader "
            r"\(DataLoader\) cannot resume mid-epoch \(it has no state_dict/load_state_dict\); resume from an "
            r"end-of-epoch checkpoint \(--checkpoint.every_n_epochs 1\) or give the datamodule a resumable train "
            r"loader \(datamodules/resumable.py\)$")):
        fit(PlainLoaderHierarchy(**sizes), ckpt_path=str(path))
    # A loader that could resume has no position to resume from (the checkpoint has none).
    with pytest.raises(ValueError, match=(
            rf"^checkpoint {path} was written in the middle of epoch 0 \(global step 6\) without the training "
            r"loader's position \(the loader that wrote it could not save one\); resume from an end-of-epoch "
            r"checkpoint \(--checkpoint.every_n_epochs 1\)$")):
        fit(HierarchyDataModule(**sizes), ckpt_path=str(path))


@pytest.mark.parametrize("num_workers, draws, refused", [(1, True, True), (0, True, False), (1, False, False)])
def test_a_mid_epoch_resume_is_refused_when_workers_draw_at_random_per_sample(num_workers, draws, refused):
    """Captioning draws the captions of an image inside the loader's workers; their random state
    is not in a checkpoint, so such a mid-epoch resume would not be exact: refused before any
    step. In the main process (num_workers 0) the loader restores the random state itself."""
    from types import SimpleNamespace

    from datamodules.resumable import ResumableSampler, refuse_unresumable_mid_epoch, training_loader

    class Drawing(torch.utils.data.Dataset):
        draws_per_sample = draws

        def __len__(self) -> int:
            return 40

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.tensor(index)

    dataset = Drawing()
    loader = training_loader(dataset, sampler=ResumableSampler(dataset, 1, 0, seed=0), batch_size=4, num_workers=num_workers)
    loader.load_state_dict(loader.state_dict())  # a position was restored: only the per-sample draws can stand in the way
    trainer = SimpleNamespace(ckpt_path="mid.ckpt", num_training_batches=10, accumulate_grad_batches=1, global_step=6,
                              current_epoch=0, train_dataloader=loader)
    if refused:
        with pytest.raises(ValueError, match=r"^checkpoint mid\.ckpt was written in the middle of epoch 0 \(global step 6\) "
                           r"but the training data \(Drawing\) draws at random per sample inside data-loader workers"):
            refuse_unresumable_mid_epoch(trainer)
    else:
        refuse_unresumable_mid_epoch(trainer)
