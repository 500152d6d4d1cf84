"""DS-Softmax trained as the paper trains it: mitosis in stages that inherit sparsity (each stage
pruned before its experts are cloned), the head's training memory (params + grads + optimizer
state) against a full softmax, counters that see training targets only, Eq. 7 hierarchy data,
``bench mitosis`` and the schedule's bad inputs through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from datamodules.hierarchy import HierarchyDataModule
from heads.base import IGNORE_INDEX
from heads.ds import DSSoftmax
from tasks.callbacks import GroupLassoPruning, Mitosis
from heads.ds.memory import training_memory
from tests.conftest import TinyConfig
from tests.shell import one_error_line, run_cli
from tests.test_ds_callbacks import tiny_data, tiny_model

ROOT = Path(__file__).resolve().parent.parent
#: configs/hierarchy/ds10x10.yaml on 4 x 3 classes, 4 samples each: one batch per epoch.
TINY_DS10 = ["--config", str(ROOT / "configs/hierarchy/ds10x10.yaml"),
             "--data.init_args.num_super", "4", "--data.init_args.num_sub", "3", "--data.init_args.train_per_class", "4",
             "--data.init_args.val_per_class", "1", "--data.init_args.test_per_class", "1",
             "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


run_dirs = TinyConfig.dirs


# ---------------------------------------------------------------------- counters (item 4)
def test_counters_exclude_ignored_targets_and_evaluation_passes():
    torch.manual_seed(0)
    head = DSSoftmax(8, 12, num_experts=3, load_balance_weight=1.0).train()
    hidden = torch.randn(2, 5, 8)
    target = torch.randint(0, 12, (2, 5))
    target[0, 3:] = IGNORE_INDEX  # padding
    target[1, 4] = IGNORE_INDEX
    head(hidden, target).sum().backward()
    assert int(head.routing_counts().sum()) == 7, "only the 7 real targets are routed contexts"
    assert float(head.last_importance().sum()) == pytest.approx(7.0), "gate mass of the real targets only"
    counts = head.routing_counts().clone()
    head.eval()
    with torch.no_grad():
        head(hidden, target), head.log_prob(hidden), head.topk(hidden.reshape(-1, 8), 2)
    assert torch.equal(head.routing_counts(), counts), "evaluation passes are not counted"


class CountsAfterEachTrainingBatch(Callback):
    def __init__(self) -> None:
        self.totals: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.totals.append(int(pl_module.head.routing_counts().sum()))


def test_a_validation_pass_between_training_steps_leaves_the_routing_counts_alone(tmp_path):
    spy = CountsAfterEachTrainingBatch()
    trainer = L.Trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=2, val_check_interval=1,
                        num_sanity_val_steps=0, callbacks=[spy], default_root_dir=tmp_path, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    model = tiny_model(num_experts=2)
    trainer.fit(model, tiny_data())
    assert spy.totals == [16, 32, 48], "3 training batches of 16; the validation passes in between add nothing"
    assert model.head.stats()["theoretical_speedup"] == pytest.approx(1.0), "dense experts: no speed-up"


# ---------------------------------------------------------------------- mitosis on the head (item 1)
def test_clone_experts_copies_kept_rows_only_and_carries_a_plain_optimizer():
    torch.manual_seed(0)
    head = DSSoftmax(8, 12, num_experts=2, group_lasso_weight=0.1)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.01)
    head(torch.randn(16, 8), torch.randint(0, 12, (16,))).mean().backward()
    optimizer.step()
    with torch.no_grad():
        head.expert_weight[::3] = 0.0  # a third of the rows below any threshold
    head.prune(0.01, optimizers=[optimizer])
    kept_before, mask_before = int(head.rows_per_expert().sum()), head.kept_mask().clone()
    assert kept_before < 2 * 12
    moments = optimizer.state[head.expert_weight]["exp_avg"].clone()
    head.clone_experts(noise=0.05, generator=torch.Generator().manual_seed(1), optimizers=[optimizer])
    assert head.num_experts == 4 and int(head.rows_per_expert().sum()) == 2 * kept_before, "only kept rows are copied"
    assert torch.equal(head.kept_mask(), torch.cat([mask_before, mask_before])), "no pruned row comes back"
    assert torch.equal(optimizer.state[head.expert_weight]["exp_avg"], torch.cat([moments, moments]))
    assert any(p is head.expert_weight for p in optimizer.param_groups[0]["params"])
    head(torch.randn(16, 8), torch.randint(0, 12, (16,))).mean().backward()
    optimizer.step()  # the optimizer trains the new parameters


def test_stage_position_follows_the_cloning_schedule():
    mitosis = Mitosis(max_experts=8, every_n_epochs=None, every_n_steps=10)
    assert [mitosis.stage_position(0, s, 2) for s in (0, 9, 10, 15, 20, 29, 35, 100)] == [0, 9, 0, 5, 0, 9, 15, 80]
    assert mitosis.last_cloning(2) == 20 and mitosis.clonings(2) == 2


# ---------------------------------------------------------------------- stages + memory (items 1, 2)
def test_each_stage_is_pruned_before_it_is_cloned_and_memory_is_logged_with_its_peak(tmp_path):
    mitosis = Mitosis(max_experts=8, every_n_epochs=None, every_n_steps=6, noise=0.05)
    pruning = GroupLassoPruning(threshold=0.1, start_epoch=None, after_cloning=3, every_n_steps=1)
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer = L.Trainer(max_epochs=8, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[mitosis, pruning],
                        default_root_dir=tmp_path, logger=logger, log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    model = tiny_model(num_experts=2, group_lasso_weight=0.01, expert_lasso_weight=0.01)
    trainer.fit(model, tiny_data())  # 6 batches per epoch: clonings at steps 6, 12
    V = 12
    report = mitosis.memory_report
    assert [r["num_experts"] for r in report] == [4.0, 8.0]
    for row in report:  # each cloning doubled a pruned head: fewer rows than dense experts
        assert row["kept_rows"] < row["num_experts"] * V
    assert report[1]["kept_rows"] <= 2 * report[0]["kept_rows"], "no pruned row is recreated by the next cloning"
    assert len(mitosis.memory_history) == trainer.global_step == 48
    assert mitosis.peak_ratio == max([r[1] for r in mitosis.memory_history] + [r["ratio"] for r in report])
    now = training_memory(model.head, trainer.optimizers)
    assert now["ratio"] == pytest.approx(mitosis.memory_history[-1][1])
    assert 0 <= now["optimizer_bytes"] - 2 * now["param_bytes"] <= 64, "Adam: two moments per element (+ step scalars)"
    png = Path(trainer.log_dir) / "mitosis_memory.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(trainer.log_dir, size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    assert "~ds/mitosis/memory" in events.Tags()["images"]
    ratios = events.Scalars("~ds/mitosis/head_memory_ratio")
    assert len(ratios) >= 48 and max(e.value for e in ratios) == pytest.approx(mitosis.peak_ratio, rel=1e-5)


def test_memory_ratio_of_dense_experts_is_their_count():
    """K dense experts without a bias or optimizer state: K * V * d + K * d over V * d + V."""
    head = DSSoftmax(8, 12, num_experts=4)
    memory = training_memory(head, [])
    assert memory["ratio"] == pytest.approx((4 * 12 * 8 + 4 * 8) / (12 * 8 + 12))


@pytest.mark.parametrize("every, after, match", [
    (5, 5, "after_cloning=5 steps is not before the next cloning .*set .*after_cloning below 5"),
    (5, 7, "after_cloning below 5")])
def test_pruning_that_would_start_after_the_next_cloning_is_refused(every, after, match, tmp_path):
    mitosis = Mitosis(max_experts=4, every_n_epochs=None, every_n_steps=every)
    pruning = GroupLassoPruning(start_epoch=None, after_cloning=after)
    trainer = L.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, callbacks=[mitosis, pruning],
                        default_root_dir=tmp_path, logger=False, enable_progress_bar=False, accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match=match) as err:
        trainer.fit(tiny_model(), tiny_data())
    assert "\n" not in str(err.value)


def test_after_cloning_needs_mitosis_and_replaces_start_epoch(tmp_path):
    with pytest.raises(ValueError, match="replaces start_epoch, got start_epoch=1 too .*start_epoch: null"):
        GroupLassoPruning(after_cloning=2)
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, default_root_dir=tmp_path, logger=False,
                        callbacks=[GroupLassoPruning(start_epoch=None, after_cloning=2)], enable_progress_bar=False)
    with pytest.raises(ValueError, match="needs a tasks.callbacks.Mitosis callback"):
        trainer.fit(tiny_model(), tiny_data())


# ---------------------------------------------------------------------- bad inputs through the CLI (item 6)
def test_cli_refuses_a_cloning_schedule_that_cannot_reach_max_experts(tmp_path):
    result = run_cli(["fit", *TINY_DS10, "--trainer.max_epochs", "2", *run_dirs(tmp_path)], tmp_path)
    line = one_error_line(result)
    assert "Mitosis cannot reach max_experts=10 from the head's num_experts=5" in line
    assert "the last at epoch 3, but the run has 2 epochs (set trainer.max_epochs to at least 4" in line
    assert not list(tmp_path.rglob("*.ckpt")), "refused before training: nothing written"


def test_cli_warns_in_one_line_naming_what_shortened_the_run(tmp_path):
    """A trial run (``limit_train_batches``) too short for the schedule trains, with one warning
    line (no source line after it) naming what ends it first: the epochs of an epoch schedule
    (``limit_train_batches`` shortens the epochs, not their number), not ``fast_dev_run``."""
    result = run_cli(["fit", *TINY_DS10, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "1",
                      "--trainer.limit_val_batches", "0", *run_dirs(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    found = [i for i, line in enumerate(lines) if "Mitosis cannot reach max_experts=10" in line]
    assert len(found) == 1, result.stderr[-2000:]
    line = lines[found[0]]
    assert "tasks/callbacks/mitosis.py:" in line and ": UserWarning: Mitosis" in line, line
    assert line.endswith("the run is shortened by trainer.max_epochs=2 (in a trial run with trainer.limit_train_batches=1), "
                         "so it goes on"), line
    assert "fast_dev_run" not in line
    assert not any("rank_zero_warn(" in other for other in lines), result.stderr[-2000:]  # Python's source line


def test_cli_refuses_a_negative_expert_lasso(tmp_path):
    result = run_cli(["fit", *TINY_DS10, "--model.init_args.head.init_args.expert_lasso_weight", "-0.001",
                      *run_dirs(tmp_path)], tmp_path)
    assert "expert_lasso_weight >= 0" in one_error_line(result) and "-0.001" in one_error_line(result)


def test_cli_warns_when_the_last_stage_is_never_pruned(tmp_path):
    """Clone at epoch 3, prune from 2 epochs after it: a 4-epoch run never prunes the 10 experts."""
    result = run_cli(["fit", *TINY_DS10, "--trainer.max_epochs", "4", "--trainer.limit_val_batches", "0",
                      *run_dirs(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "would start at epoch 5" in result.stderr and "the last stage (10 experts) is never pruned" in result.stderr


# ---------------------------------------------------------------------- bench mitosis (item 2)
def test_bench_mitosis_tiny_reports_the_peak_and_each_cloning(tmp_path):
    out = tmp_path / "mitosis.json"
    result = run_cli(["bench", "mitosis", "--tiny", "--json", str(out), "--output_dir", str(tmp_path / "runs")], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [c["num_experts"] for c in report["clonings"]] == [4, 8, 16, 32, 64] and report["final_experts"] == 64
    assert report["peak_ratio"] >= max(c["ratio"] for c in report["clonings"]) > 1.0
    assert report["clonings"][0]["kept_rows"] < 4 * report["num_classes"], "DS-2 was pruned before its first cloning"
    assert Path(report["plot"]).is_file() and "peak over the run" in result.stdout
    from app.bench.mitosis import main as bench_mitosis

    with pytest.raises(ValueError, match=r"--after_cloning < --every_n_steps \(4\), got 4"):
        bench_mitosis(["--tiny", "--after_cloning", "4"])


# ---------------------------------------------------------------------- hierarchy data (item 5)
def test_hierarchy_default_draw_is_eq7_and_the_old_draw_is_kept_as_std():
    eq7 = HierarchyDataModule(num_super=50, num_sub=4, num_features=16, train_per_class=2, val_per_class=1, test_per_class=1)
    assert eq7.stds() == pytest.approx((10**1.5, 10.0, 10**0.5)), "variances d^3, d^2, d with d = 10"
    train = eq7.generate()["train"]
    sub = train.inputs.view(2, 200, 16)  # per class: two samples
    assert float((sub[0] - sub[1]).std() / 2**0.5) == pytest.approx(10**0.5, rel=0.1), "input noise std sqrt(d)"
    old = HierarchyDataModule(num_super=4, num_sub=3, num_features=8, draw="std")
    assert old.stds() == (1.0, 0.4, 0.4)
    with pytest.raises(ValueError, match="draw in .*'eq7', 'std'.* got 'paper'"):
        HierarchyDataModule(draw="paper")


@pytest.mark.parametrize("head_kw, expected", [
    ({"group_lasso_weight": 1e-3, "expert_lasso_weight": 1e-3}, [1e-3, 5e-3, 1e-3]),  # tied, as in the paper
    ({"group_lasso_weight": 1e-3, "expert_lasso_weight": 0.0}, [0.0, 0.0, 0.0]),  # the Eq. 6 ablation stays off
    ({"group_lasso_weight": 1e-3, "expert_lasso_weight": 2e-3}, [2e-3, 1e-2, 2e-3])])
def test_the_lasso_phase_scales_the_heads_expert_lasso_too(head_kw, expected, tmp_path):
    pruning = GroupLassoPruning(start_epoch=5, phase_scale=5.0, lasso_from_epoch=1, lasso_until_epoch=2)
    seen = []

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 0:
                seen.append(pl_module.head.expert_lasso_weight)

    trainer = L.Trainer(max_epochs=3, limit_train_batches=1, limit_val_batches=0, callbacks=[pruning, Record()],
                        default_root_dir=tmp_path, logger=False, enable_progress_bar=False, accelerator="cpu", devices=1)
    trainer.fit(tiny_model(num_experts=2, **head_kw), tiny_data())
    assert seen == pytest.approx(expected)


@pytest.mark.parametrize("limit, fix", [({"max_epochs": 2}, "set trainer.max_epochs to at least 3"),
                                        ({"max_epochs": 10, "max_steps": 7}, "set trainer.max_steps to at least 13")])
def test_a_step_schedule_past_the_run_names_the_limit_that_cuts_it(limit, fix, tmp_path):
    """6 batches per epoch: clonings at steps 6 and 12 need 13 steps."""
    mitosis = Mitosis(max_experts=8, every_n_epochs=None, every_n_steps=6)
    trainer = L.Trainer(**limit, limit_val_batches=0, callbacks=[mitosis], default_root_dir=tmp_path, logger=False,
                        enable_progress_bar=False, accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match="the last at step 12, but the run has") as err:
        trainer.fit(tiny_model(), tiny_data())
    assert fix in str(err.value) and "\n" not in str(err.value)
