"""Every task stops on a non-finite loss or non-finite weights, and no NaN reaches the disk.

Through the real CLI, one tiny run per task (language model, translation, captioning, hierarchy
and Chinese-character classification): a first run trains one epoch and writes a good
``last.ckpt``; a second run in the same checkpoint directory explodes: Adam with a learning rate
of 1e37 moves every weight by about 1e37 in the first step (whose loss was finite), so the second
step's forward pass overflows float32 and its loss is Inf/NaN. (1e30 is not enough everywhere: the
LSTM LM's gates saturate and its loss stays finite; above about 3e37 Adam's first step size no
longer fits a float32 and torch itself refuses the step.)

Weights that turn non-finite inside an optimizer step while the step's loss was finite are caught
where they would be used or kept (before a checkpoint is assembled, before validation, at the end of
training): tested on the Python API with a callback that puts an Inf into a weight after the step. It must exit with code 2 and one ``error:`` line naming the step, the
epoch and the fix, print no traceback, leave ``last.ckpt`` byte for byte as it was, and leave no
checkpoint with a non-finite value anywhere (see ``tasks/finite_guard.py``).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from app.main import main
from tasks.finite_guard import NonFiniteGuard
from tests.shell import run_app, run_cli

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def task_args(task: str, tmp_path: Path) -> list[str]:
    """The shipped config of ``task`` shrunk to a few steps (the sizes the task's own tests use)."""
    if task == "lm":
        return ["--config", str(ROOT / "configs/lm/synthetic.yaml"), "--data.init_args.train_tokens", "4000",
                "--data.init_args.valid_tokens", "600", "--data.init_args.test_tokens", "600",
                "--data.init_args.vocab_size", "60", "--model.init_args.encoder.init_args.hidden_size", "24",
                "--model.init_args.encoder.init_args.last_hidden_size", "16", "--model.init_args.eval_topk", "[1]",
                "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2"]
    if task == "translation":
        return ["--config", str(ROOT / "configs/translation/synthetic_lstm.yaml"),
                "--data.init_args.data_dir", str(tmp_path / "syn"), "--data.init_args.cache_dir", str(tmp_path / "cache"),
                "--data.init_args.synthetic_size", "200", "--data.init_args.max_tokens", "60",
                "--model.init_args.network.init_args.embed_dim", "16", "--model.init_args.network.init_args.hidden_size", "16",
                "--model.init_args.val_bleu_sentences", "4", "--trainer.limit_train_batches", "4",
                "--trainer.limit_val_batches", "1"]
    if task == "captioning":
        return ["--config", str(ROOT / "configs/captioning/synthetic.yaml"), "--data.init_args.num_train", "12",
                "--data.init_args.num_val", "6", "--data.init_args.num_test", "6", "--data.init_args.image_size", "32",
                "--data.init_args.batch_size", "6", "--model.init_args.decoder.init_args.embed_dim", "16",
                "--model.init_args.decoder.init_args.hidden_size", "16", "--model.init_args.meteor", "false",
                "--model.init_args.metric_tokenizer", "simple"]
    if task == "hierarchy":
        return ["--config", str(ROOT / "configs/hierarchy/softmax10x10.yaml"), "--data.init_args.train_per_class", "4",
                "--data.init_args.val_per_class", "1", "--data.init_args.test_per_class", "1"]
    if task == "hanzi":
        return ["--config", str(ROOT / "configs/hanzi/font_rendered.yaml"), "--data.init_args.image_size", "24",
                "--data.init_args.num_classes_limit", "8", "--data.init_args.train_writers", "2",
                "--data.init_args.batch_size", "8", "--model.init_args.encoder.init_args.channels", "[8, 16, 16]",
                "--model.init_args.encoder.init_args.out_features", "16", "--data.init_args.cache_dir",
                str(tmp_path / "cache"), "--trainer.limit_train_batches", "3"]
    raise AssertionError(task)




def all_finite(path: Path) -> bool:
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    return all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


DDP = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]


@pytest.mark.parametrize("task", ["lm", "translation", "captioning", "hierarchy", "hanzi",
                                  pytest.param("hierarchy-ddp", marks=pytest.mark.slow)])
def test_an_exploding_run_stops_with_one_line_and_keeps_the_good_checkpoint(tmp_path, task):
    """``hierarchy-ddp``: 2 gloo processes stop with exit code 2 and keep the good checkpoint too."""
    extra = DDP if task.endswith("-ddp") else []
    task = task.removesuffix("-ddp")
    common = [*task_args(task, tmp_path), *extra, *QUIET, "--trainer.default_root_dir", str(tmp_path),
              "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--checkpoint.dirpath", str(tmp_path / "ckpt")]
    if extra:  # several processes: from the shell
        good = run_app(["fit", *common, "--trainer.max_epochs", "1"], tmp_path)
        assert good.returncode == 0, good.stderr[-3000:]
    else:  # in this process (one thread, see conftest.py)
        main(["fit", *common, "--trainer.max_epochs", "1"])
    last = tmp_path / "ckpt" / "last.ckpt"
    before = last.read_bytes()
    assert all_finite(last)

    explode = ["fit", *common, "--trainer.max_epochs", "2", "--model.init_args.optimizer.init_args.lr", "1e37"]
    exploding = run_app(explode, tmp_path) if extra else run_cli(explode, tmp_path)
    assert exploding.returncode == 2, exploding.stderr[-3000:]
    assert "Traceback" not in exploding.stderr, exploding.stderr[-3000:]
    errors = [line for line in exploding.stderr.splitlines() if line.startswith("error:")]
    # Under DDP every rank runs app/main.py and prints the same line, but rank 1 can be torn down by
    # the launching rank 0's exit before it writes: one or two identical lines.
    assert (1 <= len(errors) <= 2 if extra else len(errors) == 1) and len(set(errors)) == 1, exploding.stderr[-3000:]
    assert errors[0].startswith("error: non-finite training loss "), errors[0]
    assert "at global step 1, epoch 0, batch 1;" in errors[0] and "learning rate 1e+37" in errors[0], errors[0]
    assert errors[0].endswith("lower the learning rate (--model.init_args.optimizer.init_args.lr) or clip gradients "
                              "(--trainer.gradient_clip_val 1.0), then resume from the last checkpoint"), errors[0]
    assert last.read_bytes() == before, "the good last.ckpt was replaced"
    for path in (tmp_path / "ckpt").glob("*.ckpt"):
        assert all_finite(path), f"{path.name} holds non-finite values"


class Overflow(pl.Callback):
    """After the first optimizer step, sets one weight to inf (what an overflowing update does)."""

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        with torch.no_grad():
            next(pl_module.parameters()).view(-1)[0] = float("inf")


@pytest.mark.parametrize("where, trainer_args", [
    # A step checkpoint right after the step (Lightning runs ModelCheckpoint after other callbacks).
    ("before writing a checkpoint", dict(limit_val_batches=0, checkpoint_every=1)),
    # The epoch ends with that step: validation would score (and monitor) NaN weights.
    ("before validation", dict(limit_val_batches=1, checkpoint_every=None)),
    # No validation, no checkpoint, no later step: the run must still not end as a success.
    ("at the end of training", dict(limit_val_batches=0, checkpoint_every=None)),
])
def test_weights_made_non_finite_by_an_optimizer_step_stop_the_run(tmp_path, where, trainer_args):
    from datamodules.hierarchy import HierarchyDataModule
    from tasks.classification import ClassificationTask
    from tasks.encoders import MLPEncoder

    data = HierarchyDataModule(num_super=2, num_sub=2, num_features=4, train_per_class=4, batch_size=4)
    model = ClassificationTask(num_classes=4, encoder=MLPEncoder(4, [8]), eval_topk=(1,), predict_topk=1)
    every = trainer_args["checkpoint_every"]
    callbacks = [Overflow()]
    if every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_last=True))
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=trainer_args["limit_val_batches"],
                         num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(every), callbacks=callbacks)
    with pytest.raises(FloatingPointError, match=rf"non-finite weights {where} at global step 1, epoch [01] \(learning "
                                                 r"rate 0.001\): encoder.layers.0.weight holds 0 NaN and 1 Inf of 32 values"):
        trainer.fit(model, data)
    assert not list(tmp_path.glob("*.ckpt"))
    assert any(isinstance(c, NonFiniteGuard) for c in trainer.callbacks), "HeadTask adds the guard itself"


def test_a_step_size_beyond_the_float_range_is_one_line(tmp_path):
    """Adam at a learning rate of 1e39: torch refuses the step size itself (a RuntimeError and a
    traceback without the guard)."""
    done = run_cli(["fit", *task_args("hierarchy", tmp_path), *QUIET, "--trainer.default_root_dir", str(tmp_path),
                    "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--checkpoint.dirpath", str(tmp_path / "ckpt"),
                    "--model.init_args.optimizer.init_args.lr", "1e39"], tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: the optimizer step at global step 0, epoch 0 (learning rate 1e+39) overflows (value cannot be converted "
        "to type float without overflow); nothing was written from it: lower the learning rate "
        "(--model.init_args.optimizer.init_args.lr) or clip gradients (--trainer.gradient_clip_val 1.0), then resume "
        "from the last checkpoint"], done.stderr[-3000:]
    assert not list(tmp_path.rglob("*.ckpt"))
