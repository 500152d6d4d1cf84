"""Exact resume of a DS-Softmax language model across a mitosis and a pruning step.

The real CLI trains the tiny synthetic language model of tests/test_resume.py with the
DS-Softmax head of ``configs/heads/ds8.yaml`` and a shrunk schedule: the experts are cloned
every 4 optimisation steps (2 -> 4 -> 8 -> 16 at steps 4, 8 and 12) and rows below
γ = 0.12 are pruned every 3 steps from the start. The interrupted run is SIGKILLed after
step 11; its last checkpoint is from step 9, after two cloning steps and three pruning passes.
The run resumed from it (a model built from the *original* config, K = 2 dense experts, resized
by the checkpoint's head structure) must end with the uninterrupted run's parameters, head
structure (expert count, kept classes per expert), final val/loss and callback state (memory
report, pruned-row count, the epoch's routed load and importance, sparsity figures): the third
cloning step and two more pruning passes happen after the resume.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from app.main import main
from tasks.callbacks import GroupLassoPruning, LoadBalancing, Mitosis, SparsityTracker
from tests.shell import run_cli
from tests.test_resume import ROOT, TINY_SYNTHETIC, assert_resumed_equals, loader_position, run_app, run_dirs

DS8 = ROOT / "configs/heads/ds8.yaml"

#: The DS-Softmax schedule of configs/heads/ds8.yaml shrunk to a 16-step run.
DS_CALLBACKS: list[tuple[str, dict[str, Any]]] = [
    ("tasks.callbacks.Mitosis", {"max_experts": 16, "every_n_epochs": None, "every_n_steps": 4, "noise": 0.05}),
    ("tasks.callbacks.GroupLassoPruning", {"threshold": 0.12, "start_epoch": 0, "every_n_steps": 3}),
    ("tasks.callbacks.LoadBalancing", {}),
    ("tasks.callbacks.SparsityTracker", {"heatmap": False}),
]


class RecordDS(pl.Callback):
    """Writes the final parameters, val/loss, head structure and DS callback state (rank 0; every
    rank joins, since the callbacks' ``state_dict`` sums their epoch statistics over ranks)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        head = pl_module.head
        callbacks: dict[str, Any] = {}
        for callback in trainer.callbacks:
            if isinstance(callback, (Mitosis, GroupLassoPruning, LoadBalancing)):
                callbacks[type(callback).__name__] = callback.state_dict()
            elif isinstance(callback, SparsityTracker):
                callbacks["SparsityTracker"] = {"last": callback.last, "smallest_experts": callback.smallest_experts}
        if not trainer.is_global_zero:
            return
        torch.save({
            "params": {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()},
            "val_loss": float(trainer.callback_metrics["val/loss"]),
            "global_step": trainer.global_step,
            "structure": head.structure(),
            "kept_mask": head.kept_mask().cpu(),
            "callbacks": callbacks,
        }, self.path)


def ds_config(path: Path, extra: tuple[str, dict[str, Any]]) -> Path:
    """trainer.callbacks = the DS schedule + one test callback (a later --config replaces the list)."""
    lines = ["trainer:", "  callbacks:"]
    for class_path, init_args in [*DS_CALLBACKS, extra]:
        args = ", ".join(f"{k}: {'null' if v is None else repr(v)}" for k, v in init_args.items())
        lines += [f"    - class_path: {class_path}", f"      init_args: {{{args}}}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def assert_same_tensors(a: Any, b: Any, where: str) -> None:
    """Nested dicts/lists of tensors and numbers are equal, bit for bit."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.slow  # kill -9 of a process of its own
def test_ds_softmax_sigkill_after_mitosis_and_pruning_then_resume_matches_uninterrupted_run(tmp_path):
    check_ds_resume(tmp_path, [])


@pytest.mark.slow
def test_two_process_ddp_ds_softmax_sigkill_then_resume_matches_uninterrupted_ddp_run(tmp_path):
    """The same schedule with 2 gloo processes x 8 rows: the cloning steps rebuild the DDP
    wrapper, and the callbacks' epoch load and importance are checkpointed as sums over both
    ranks and given back to rank 0, so the epoch-end figures (summed over ranks) match too."""
    check_ds_resume(tmp_path, ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
                               "--data.init_args.batch_size", "8", "--data.init_args.eval_batch_size", "8"])


def check_ds_resume(tmp_path: Path, extra: list[str]) -> None:
    args = [*TINY_SYNTHETIC, "--config", str(DS8), *extra]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    for d in (straight, broken):
        d.mkdir()
    record = "tests.test_resume_ds.RecordDS"
    straight_args = ["fit", *args, *run_dirs(straight), "--config",
                     str(ds_config(straight / "cb.yaml", (record, {"path": str(straight / "final.pt")})))]
    if extra:  # several processes: from the shell
        done = run_app(straight_args, straight)
        assert done.returncode == 0, done.stderr[-3000:]
    else:  # in this process (one thread, see conftest.py): saves an interpreter start
        main(straight_args)

    killed = run_app(["fit", *args, *run_dirs(broken), "--config",
                      str(ds_config(broken / "kill.yaml", ("tests.test_resume.KillAt", {"step": 11})))], broken)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = torch.load(broken / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 9, "the kill must land after the step-9 checkpoint and before the next one"
    # Before the kill point: cloning at steps 4 and 8 (2 -> 8 experts), pruning at steps 3, 6 and 9.
    structure = saved["head_structure"]
    assert structure["num_experts"] == 8
    assert sum(structure["rows_per_expert"]) < 8 * 60, "the schedule must have pruned rows before the checkpoint"
    states = {key.split("{")[0]: value for key, value in saved["callbacks"].items()}
    assert states["GroupLassoPruning"]["pruned_rows"] > 0
    assert [row["num_experts"] for row in states["Mitosis"]["memory_report"]] == [4.0, 8.0]
    assert states["LoadBalancing"]["epoch"] == 1 and states["LoadBalancing"]["load"].sum() > 0

    resume = run_app if extra else run_cli  # several processes: from the shell
    resumed = resume(["fit", *args, *run_dirs(broken), "--ckpt_path", "last", "--config",
                      str(ds_config(broken / "cb.yaml", (record, {"path": str(broken / "final.pt")})))], broken)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not resumable" not in resumed.stderr, "Lightning must see a resumable train loader"

    a, b = torch.load(broken / "final.pt"), torch.load(straight / "final.pt")
    assert a["global_step"] == b["global_step"] == 16
    assert b["structure"]["num_experts"] == 16, "the third cloning step (step 12) must happen after the resume"
    assert a["structure"] == b["structure"] and torch.equal(a["kept_mask"], b["kept_mask"])
    diff = assert_resumed_equals(a, b)
    assert_same_tensors(a["callbacks"], b["callbacks"], "callbacks")
    assert b["callbacks"]["GroupLassoPruning"]["pruned_rows"] > states["GroupLassoPruning"]["pruned_rows"]
    # Shown with pytest -s; docs/results/reliability.md (R5, R6) records these figures.
    print(f"DS-Softmax resume: largest parameter relative difference {diff:.3g}; final val/loss resumed "
          f"{a['val_loss']!r}, uninterrupted {b['val_loss']!r}; experts {a['structure']['num_experts']}, kept rows "
          f"{sum(a['structure']['rows_per_expert'])} of {16 * 60} (checkpoint: {structure['num_experts']} experts, "
          f"{sum(structure['rows_per_expert'])} rows); pruned rows {a['callbacks']['GroupLassoPruning']['pruned_rows']}")


def test_pruning_on_a_loss_target_resumes_with_the_last_monitored_value():
    """With ``loss_below`` on a metric logged only now and then (``val/loss``), a resumed run
    has no value for it until the next validation (Lightning does not restore
    ``callback_metrics``): the checkpointed last value keeps the uninterrupted decision."""
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert "val/loss" not in trainer.callback_metrics
    fresh = GroupLassoPruning(threshold=0.1, start_epoch=None, loss_below=2.0, monitor="val/loss")
    assert not fresh.active(trainer), "no value seen yet: the target is not reached"
    resumed = GroupLassoPruning(threshold=0.1, start_epoch=None, loss_below=2.0, monitor="val/loss")
    resumed.load_state_dict({"pruned_rows": 7, "last_monitored": 1.5})
    assert resumed.active(trainer) and resumed.pruned_rows == 7
    resumed.load_state_dict({"pruned_rows": 7, "last_monitored": 2.5})
    assert not resumed.active(trainer)
    assert resumed.state_dict() == {"pruned_rows": 7, "last_monitored": 2.5, "gated_passes": 0}


# ------------------------------------------------------------------ classification (hierarchy)
HIERARCHY_DS = ROOT / "configs/hierarchy/ds10x10.yaml"

#: configs/hierarchy/ds10x10.yaml shrunk: 4 x 5 classes, 160 training samples in 10 batches of 16
#: per epoch, 2 experts cloned every 4 steps up to 16, rows pruned every 3 steps from the start,
#: dropout on (so the resumed random state matters), a checkpoint every 3 steps.
TINY_HIERARCHY_DS = [
    "--config", str(HIERARCHY_DS),
    "--data.init_args.num_super", "4", "--data.init_args.num_sub", "5", "--data.init_args.train_per_class", "8",
    "--data.init_args.val_per_class", "2", "--data.init_args.test_per_class", "1", "--data.init_args.batch_size", "16",
    "--model.init_args.encoder.init_args.dropout", "0.2", "--model.init_args.head.init_args.num_experts", "2",
    "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    "--trainer.log_every_n_steps", "1",
]
HIERARCHY_DS_CALLBACKS: list[tuple[str, dict[str, Any]]] = [
    ("tasks.callbacks.Mitosis", {"max_experts": 16, "every_n_epochs": None, "every_n_steps": 4, "noise": 0.05}),
    ("tasks.callbacks.GroupLassoPruning", {"threshold": 0.3, "start_epoch": 0, "every_n_steps": 3}),
    ("tasks.callbacks.LoadBalancing", {}),
    ("tasks.callbacks.SparsityTracker", {"heatmap": False}),
]


def callbacks_yaml(path: Path, callbacks: list[tuple[str, dict[str, Any]]]) -> Path:
    lines = ["trainer:", "  callbacks:"]
    for class_path, init_args in callbacks:
        args = ", ".join(f"{k}: {'null' if v is None else repr(v)}" for k, v in init_args.items())
        lines += [f"    - class_path: {class_path}", f"      init_args: {{{args}}}"]
    path.write_text("\n".join(lines) + "\n")
    return path


HIERARCHY_DDP = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp",
                 "--data.init_args.batch_size", "8"]


@pytest.mark.slow  # kill -9 of a process of its own
@pytest.mark.parametrize("extra, kill_step, last_step, position", [
    ([], 14, 12, (1, 2)),
    # Checkpoints at epoch ends only: the step-10 one, after validation; the random state goes back
    # at the first batch of epoch 1.
    pytest.param(["--checkpoint.every_n_train_steps", "null", "--checkpoint.every_n_epochs", "1"], 12, 10, (0, 10),
                 id="end-of-epoch"),
    # 2 gloo processes x 8 rows: each rank continues its own share of the epoch's permutation.
    pytest.param(HIERARCHY_DDP, 14, 12, (1, 2), id="ddp"),
])
def test_hierarchy_ds_softmax_sigkill_mid_epoch_then_resume_matches_uninterrupted_run(tmp_path, extra, kill_step, last_step,
                                                                                      position):
    """20 steps (2 epochs of 10 batches). Step checkpoints wait for the first validation (they
    monitor val/loss), so the run killed after step 14 has last.ckpt from step 12: epoch 1, 2
    batches in, after two cloning steps (2 -> 8 experts after steps 4 and 8) and four pruning
    passes; the third cloning step (after step 12) happens after the resume. The resumed run must
    continue the epoch's order at its third batch with the saved random state (dropout) and end
    with the same val/loss, parameters and pruned structure."""
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    for d in (straight, broken):
        d.mkdir()
    record = ("tests.test_resume_ds.RecordDS", {"path": str(straight / "final.pt")})
    straight_args = ["fit", *TINY_HIERARCHY_DS, *run_dirs(straight), *extra, "--config",
                     str(callbacks_yaml(straight / "cb.yaml", [*HIERARCHY_DS_CALLBACKS, record]))]
    if extra == HIERARCHY_DDP:  # several processes: from the shell
        done = run_app(straight_args, straight)
        assert done.returncode == 0, done.stderr[-3000:]
    else:  # in this process (one thread, see conftest.py)
        main(straight_args)

    args = [*TINY_HIERARCHY_DS, *run_dirs(broken), *extra]
    killed = run_app(["fit", *args, "--config", str(callbacks_yaml(
        broken / "kill.yaml", [*HIERARCHY_DS_CALLBACKS, ("tests.test_resume.KillAt", {"step": kill_step})]))], broken)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = torch.load(broken / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == last_step, "the kill must land after the last checkpoint and before the next one"
    loader_state = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_position(loader_state) == position
    assert saved["head_structure"]["num_experts"] == 8

    resume = run_app if extra is HIERARCHY_DDP else run_cli  # several processes: from the shell
    resumed = resume(["fit", *args, "--ckpt_path", "last", "--config", str(callbacks_yaml(
        broken / "cb.yaml", [*HIERARCHY_DS_CALLBACKS, ("tests.test_resume_ds.RecordDS", {"path": str(broken / "final.pt")})]))],
        broken)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not resumable" not in resumed.stderr, "Lightning must see a resumable train loader"

    a, b = torch.load(broken / "final.pt"), torch.load(straight / "final.pt")
    assert a["global_step"] == b["global_step"] == 20
    assert b["structure"]["num_experts"] == 16, "the third cloning step (before step 13) must happen after the resume"
    assert b["callbacks"]["GroupLassoPruning"]["pruned_rows"] > saved["callbacks"][
        next(k for k in saved["callbacks"] if k.startswith("GroupLassoPruning"))]["pruned_rows"] > 0
    assert a["structure"] == b["structure"] and torch.equal(a["kept_mask"], b["kept_mask"])
    diff = assert_resumed_equals(a, b, "hierarchy DS-Softmax run")
    print(f"hierarchy DS-Softmax resume from step {last_step} {extra}: largest parameter relative difference {diff:.3g}; final val/loss "
          f"resumed {a['val_loss']!r}, uninterrupted {b['val_loss']!r}; kept rows {sum(a['structure']['rows_per_expert'])}")
