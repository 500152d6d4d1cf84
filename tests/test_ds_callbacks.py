"""DS-Softmax callbacks in real Lightning runs on a tiny hierarchy: mitosis (optimizer state,
schedule, memory report), pruning, balancing, sparsity tracking, checkpoints after structure
changes, a 2-process gloo DDP run through a mitosis step, bad input."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from datamodules.hierarchy import HierarchyDataModule
from heads.ds import DSSoftmax
from tasks.callbacks import GroupLassoPruning, LoadBalancing, Mitosis, RoutingLoss, SparsityTracker
from tasks.callbacks.sparsity import class_groups, expert_class_figure
from tasks.callbacks.surgery import apply_structure_change
from tasks.classification import ClassificationTask
from tasks.encoders import MLPEncoder


def tiny_data(**kw) -> HierarchyDataModule:
    args = dict(num_super=4, num_sub=3, num_features=8, train_per_class=8, val_per_class=2, test_per_class=4, batch_size=16)
    return HierarchyDataModule(**{**args, **kw})


def tiny_model(num_experts: int = 2, **head_kw) -> ClassificationTask:
    return ClassificationTask(12, MLPEncoder(8, (16,)), tiny_head(num_experts, **head_kw),
                              optimizer=partial(torch.optim.Adam, lr=0.01))


def tiny_head(num_experts: int = 2, **head_kw):
    return partial(DSSoftmax, num_experts=num_experts, **head_kw)


def trainer(tmp_path: Path, callbacks, epochs: int, **kw) -> L.Trainer:
    args = dict(max_epochs=epochs, callbacks=callbacks, default_root_dir=tmp_path, logger=False,
                limit_train_batches=3, limit_val_batches=0, num_sanity_val_steps=0,
                enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    return L.Trainer(**{**args, **kw})


class OptimizerSpy(Callback):
    """Records the head's Adam state before (first in the list) / after (last) Mitosis."""

    def __init__(self) -> None:
        self.snapshots: list[dict] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        head = pl_module.head
        state = optimizer.state.get(head.expert_weight, {})
        self.snapshots.append({
            "experts": head.num_experts,
            "in_optimizer": id(head.expert_weight) in params and id(head.gate_weight) in params,
            "exp_avg": state["exp_avg"].clone() if "exp_avg" in state else None,
            "gate_avg": optimizer.state.get(head.gate_weight, {}).get("exp_avg"),
        })


def test_mitosis_doubles_on_schedule_and_carries_optimizer_state(tmp_path):
    before, after = OptimizerSpy(), OptimizerSpy()
    mitosis = Mitosis(max_experts=8, every_n_epochs=1, noise=0.01)
    model = tiny_model()
    trainer(tmp_path, [before, mitosis, after], epochs=4).fit(model, tiny_data())
    assert [s["experts"] for s in after.snapshots] == [2, 4, 8, 8]
    assert all(s["in_optimizer"] for s in after.snapshots), "new parameters must be in the optimizer"
    # epoch 1: expert rows of the clones start from their parents' Adam moments
    old, new = before.snapshots[1]["exp_avg"], after.snapshots[1]["exp_avg"]
    assert torch.equal(new, torch.cat([old, old]))
    assert after.snapshots[1]["gate_avg"].shape[0] == 4
    assert [row["num_experts"] for row in mitosis.memory_report] == [4.0, 8.0]
    assert mitosis.memory_report[1]["head_param_bytes"] > mitosis.memory_report[0]["head_param_bytes"] > 0
    assert mitosis.memory_report[1]["head_optimizer_bytes"] > 0


def test_step_based_mitosis_and_schedule_survives_resume():
    mitosis = Mitosis(max_experts=16, every_n_epochs=None, every_n_steps=5)
    assert [mitosis.target_experts(0, s, initial_experts=2) for s in (0, 4, 5, 10, 100)] == [2, 2, 4, 8, 16]


@pytest.mark.parametrize(
    "kwargs, match",
    [({"every_n_epochs": 1, "every_n_steps": 5}, "exactly one"),
     ({"noise": -1.0}, "noise >= 0"),
     ({"max_experts": 0}, "max_experts >= 1")],
)
def test_mitosis_bad_input_is_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        Mitosis(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "initial, maximum, match",
    [(2, 48, "reachable from the head's num_experts by doubling, got num_experts=2 and max_experts=48 "
             r"\(set trainer.callbacks.Mitosis.init_args.max_experts to 64, or model.init_args.head.init_args.num_experts to 3\)"),
     (4, 2, "reachable"),
     (3, 8, "max_experts to 6, or model.init_args.head.init_args.num_experts to 2")],
)
def test_mitosis_refuses_a_max_experts_off_the_heads_doubling_path(initial, maximum, match, tmp_path):
    with pytest.raises(ValueError, match=match) as err:
        trainer(tmp_path, [Mitosis(max_experts=maximum)], epochs=1).fit(tiny_model(num_experts=initial), tiny_data())
    assert "\n" not in str(err.value)


def test_mitosis_starts_from_the_num_experts_the_head_was_built_with():
    """K0 is the head's constructor argument, also after a checkpoint resized the head."""
    head = DSSoftmax(8, 12, num_experts=2)
    head.load_structure({"num_experts": 8, "rows_per_expert": [12] * 8, "num_classes": 12, "in_features": 8})
    assert head.num_experts == 8 and head.initial_experts == 2
    assert Mitosis(max_experts=16, every_n_epochs=2).target_experts(4, 0, head.initial_experts) == 8


def test_callbacks_refuse_a_head_without_sparse_experts(tmp_path):
    model = ClassificationTask(12, MLPEncoder(8, (16,)), "softmax")
    with pytest.raises(ValueError, match="sparse-experts interface"):
        trainer(tmp_path, [GroupLassoPruning(0.1)], epochs=1).fit(model, tiny_data())


def test_pruning_shrinks_the_head_keeps_every_class_and_training_continues(tmp_path):
    pruning = GroupLassoPruning(threshold=0.5, start_epoch=1, every_n_steps=1)
    model = tiny_model(num_experts=4, group_lasso_weight=0.01)
    rows_before = int(model.head.rows_per_expert().sum())
    fitted = trainer(tmp_path, [pruning], epochs=3)
    fitted.fit(model, tiny_data())
    head = model.head
    assert pruning.pruned_rows > 0 and int(head.rows_per_expert().sum()) == rows_before - pruning.pruned_rows
    assert head.kept_mask().any(0).all(), "every class keeps at least one copy"
    trained = [p for group in fitted.optimizers[0].param_groups for p in group["params"]]
    assert any(p is head.expert_weight for p in trained), "the optimizer trains the compacted parameter"


@pytest.mark.parametrize(
    "make, match",
    [(lambda: GroupLassoPruning(threshold=-0.1), "threshold >= 0"),
     (lambda: GroupLassoPruning(start_epoch=None, loss_below=None), "start_epoch, after_cloning or loss_below"),
     (lambda: GroupLassoPruning(phase_scale=-1.0), "phase_scale >= 0"),
     (lambda: GroupLassoPruning(outside_scale=-1.0), "outside_scale >= 0"),
     (lambda: GroupLassoPruning(lasso_from_epoch=-1), "lasso_from_epoch >= 0"),
     (lambda: GroupLassoPruning(lasso_from_epoch=2, lasso_until_epoch=2), "lasso_until_epoch > lasso_from_epoch"),
     (lambda: RoutingLoss(from_epoch=-1), "from_epoch >= 0"),
     (lambda: LoadBalancing(warmup_epochs=-1), "warmup_epochs"),
     (lambda: LoadBalancing(until_epoch=0), "until_epoch >= 1")],
)
def test_pruning_and_balancing_bad_input_is_one_line(make, match):
    with pytest.raises(ValueError, match=match) as err:
        make()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("epochs, expected", [(1, 1e-4), (3, 5e-4)])
def test_pruning_scales_the_head_lambda_from_its_epoch(tmp_path, epochs, expected):
    pruning = GroupLassoPruning(threshold=0.0, start_epoch=5, phase_scale=5.0, lasso_from_epoch=1)
    model = tiny_model(group_lasso_weight=1e-4, expert_lasso_weight=2e-4)
    trainer(tmp_path, [pruning], epochs=epochs).fit(model, tiny_data())
    assert model.head.group_lasso_weight == pytest.approx(expected)
    assert model.head.expert_lasso_weight == pytest.approx(2 * expected), "λ_expert is scaled alike"
    assert [pruning.lasso_weights_at(e)[0] for e in (0, 1, 7)] == pytest.approx([1e-4, 5e-4, 5e-4])


@pytest.mark.parametrize("epochs, expected", [(2, 0.5), (3, 0.0)])
def test_a_pruning_phase_with_outside_scale_zero_is_the_only_lasso(tmp_path, epochs, expected):
    pruning = GroupLassoPruning(threshold=0.0, start_epoch=5, outside_scale=0.0, lasso_from_epoch=1, lasso_until_epoch=2)
    model = tiny_model(group_lasso_weight=0.5)
    trainer(tmp_path, [pruning], epochs=epochs).fit(model, tiny_data())
    assert model.head.group_lasso_weight == expected
    assert [pruning.lasso_weights_at(e)[0] for e in range(4)] == [0.0, 0.5, 0.0, 0.0]


def test_routing_loss_callback_switches_the_weight_on_from_its_epoch(tmp_path):
    """λ_route is 0 before ``from_epoch``, the head's own value from it on, and the routing term
    then reaches the training loss (pruning has made it non-zero)."""
    class Spy(Callback):
        def __init__(self):
            self.weights, self.routing = {}, {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.weights.setdefault(trainer.current_epoch, set()).add(pl_module.head.routing_loss_weight)
            self.routing.setdefault(trainer.current_epoch, []).append(float(pl_module.head.regularization().get("routing", 0.0)))

    pruning = GroupLassoPruning(threshold=0.3, start_epoch=1, every_n_steps=1, outside_scale=0.0, lasso_from_epoch=1)
    spy = Spy()
    model = tiny_model(num_experts=4, routing_loss_weight=0.5, group_lasso_weight=0.05)
    trainer(tmp_path, [pruning, RoutingLoss(from_epoch=2), spy], epochs=3).fit(model, tiny_data())
    assert spy.weights == {0: {0.0}, 1: {0.0}, 2: {0.5}}
    assert all(r == 0.0 for r in spy.routing[1]) and any(r > 0 for r in spy.routing[2])


def test_routing_loss_callback_refuses_a_head_without_a_routing_loss_weight(tmp_path):
    with pytest.raises(ValueError, match="RoutingLoss needs the head's routing_loss_weight > 0, got 0.0") as err:
        trainer(tmp_path, [RoutingLoss(from_epoch=1)], epochs=1).fit(tiny_model(), tiny_data())
    assert "\n" not in str(err.value)


def test_pruning_waits_for_the_task_loss_target(tmp_path):
    pruning = GroupLassoPruning(threshold=10.0, start_epoch=None, loss_below=-1.0, every_n_steps=1)
    model = tiny_model()
    trainer(tmp_path, [pruning], epochs=1).fit(model, tiny_data())
    assert pruning.pruned_rows == 0, "a loss target never reached must not prune"
    assert pruning.last_monitored is not None, "the task logs the monitored train/loss"


def test_pruning_starts_once_the_task_loss_is_below_its_target(tmp_path):
    pruning = GroupLassoPruning(threshold=10.0, start_epoch=None, loss_below=1e9, every_n_steps=1)
    trainer(tmp_path, [pruning], epochs=1).fit(tiny_model(), tiny_data())
    assert pruning.pruned_rows > 0


def test_a_stage_whose_loss_gate_stays_closed_counts_and_logs_the_held_passes(tmp_path):
    """Algorithm 1, line 7 on the mitosis schedule: every scheduled pass the gate holds back is
    counted (checkpointed) and logged as ``~ds/pruning/loss_gate_open`` 0, so a user sees whether
    the gate or the step schedule decided."""
    pruning = GroupLassoPruning(threshold=10.0, start_epoch=None, after_cloning=0, loss_below=-1.0, every_n_steps=1)
    sink = MetricsSink()
    trainer(tmp_path, [Mitosis(max_experts=4, every_n_epochs=None, every_n_steps=2), pruning], epochs=1,
            logger=sink).fit(tiny_model(), tiny_data())
    assert pruning.pruned_rows == 0 and pruning.gated_passes == 3, "three scheduled passes, all held back"
    assert sink.metrics["~ds/pruning/loss_gate_open"] == 0.0 and sink.metrics["~ds/pruning/gated_passes"] == 3.0
    assert pruning.state_dict()["gated_passes"] == 3


def test_a_pruning_monitor_the_task_does_not_log_is_one_line(tmp_path):
    pruning = GroupLassoPruning(threshold=10.0, start_epoch=None, loss_below=1.0, every_n_steps=1, monitor="train/task_loss")
    with pytest.raises(ValueError, match=r"monitors 'train/task_loss', which the task does not log \(training metrics "
                                         r"logged: .*train/loss.*\); set trainer.callbacks.GroupLassoPruning.init_args.monitor"):
        trainer(tmp_path, [pruning], epochs=1).fit(tiny_model(), tiny_data())


class MetricsSink(L.pytorch.loggers.Logger):
    """A real (in-memory) logger: keeps every metric it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    @property
    def name(self) -> str:
        return "sink"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.update(metrics)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def test_load_balancing_schedule_and_sparsity_tracker_logs(tmp_path):
    balancing = LoadBalancing(warmup_epochs=2)
    tracker = SparsityTracker()
    sink = MetricsSink()
    model = tiny_model(num_experts=4, load_balance_weight=0.4)
    trainer(tmp_path, [balancing, tracker], epochs=2, logger=sink).fit(model, tiny_data())
    assert balancing.weight_at(0) == pytest.approx(0.2) and model.head.load_balance_weight == pytest.approx(0.4)
    for key in ("~ds/balance/cv_load", "~ds/balance/cv_importance", "~ds/sparsity/theoretical_speedup",
                "~ds/sparsity/flops_reduction", "~ds/sparsity/head_memory_mib", "~ds/sparsity/mean_redundancy"):
        assert key in sink.metrics, key
    assert sink.metrics["~ds/sparsity/theoretical_speedup"] == pytest.approx(1.0)  # nothing pruned yet
    assert len(tracker.smallest_experts) == 3 and tracker.smallest_experts[0]["classes"][0].startswith("s")


def test_load_balancing_ends_at_its_until_epoch(tmp_path):
    balancing = LoadBalancing(warmup_epochs=2, until_epoch=2)
    assert [balancing.scale_at(e) for e in range(4)] == pytest.approx([0.5, 1.0, 0.0, 0.0])
    model = tiny_model(num_experts=4, load_balance_weight=0.4)
    trainer(tmp_path, [balancing], epochs=3).fit(model, tiny_data())
    assert [balancing.weight_at(e) for e in range(4)] == pytest.approx([0.2, 0.4, 0.0, 0.0])
    assert model.head.load_balance_weight == 0.0


def test_heatmap_columns_are_grouped_by_super_class(tmp_path):
    data = tiny_data()
    fitted = trainer(tmp_path, [], epochs=1, limit_train_batches=1)
    fitted.fit(tiny_model(), data)
    order = SparsityTracker.class_order(12, fitted)
    supers = torch.as_tensor(data.super_class_of)[order]
    assert torch.equal(supers, supers.sort().values)


def test_tensorboard_gets_histograms_and_heatmap(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = L.pytorch.loggers.TensorBoardLogger(tmp_path, name="tb")
    fitted = trainer(tmp_path, [SparsityTracker()], epochs=1, logger=logger)
    fitted.fit(tiny_model(), tiny_data())
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    [heatmap] = events.Images("~ds/sparsity/expert_class_heatmap")
    assert heatmap.step == fitted.global_step == 3, "at the global step, as the scalars (not the epoch)"
    assert heatmap.width >= 600 and heatmap.height >= 200, "a labelled figure, not a K x V pixel strip"
    assert {"~ds/sparsity/utilisation", "~ds/sparsity/redundancy"} <= set(events.Tags()["histograms"])
    assert {e.step for e in events.Histograms("~ds/sparsity/utilisation")} == {3}
    assert os.path.exists(os.path.join(logger.log_dir, "smallest_experts.txt"))


def test_heatmap_groups_classes_into_blocks_and_bins_a_large_vocabulary():
    K, V = 8, 10_000
    home = torch.arange(V) % K  # each expert keeps every K-th class: interleaved by id
    mask = torch.zeros(K, V, dtype=torch.bool)
    mask[home, torch.arange(V)] = True
    order, groups = class_groups(mask)
    assert torch.equal(groups, home.sort().values), "classes grouped by the expert that keeps them"
    assert torch.equal(mask[:, order], torch.repeat_interleave(torch.eye(K, dtype=torch.bool), V // K, dim=1))
    figure = expert_class_figure(mask)
    ax, colour_bar = figure.axes
    assert ax.get_ylabel().startswith("experts") and ax.get_xlabel().startswith("classes")
    assert "20 per column" in ax.get_xlabel() and colour_bar.get_ylabel() == "share of the column's classes kept"
    shown = ax.images[0].get_array()
    assert shown.shape == (K, 500), "binned to at most MAX_HEATMAP_COLUMNS columns"
    assert float(shown.sum()) == pytest.approx(500.0), "a block diagonal: every column is one expert's"
    supers = [c % 3 for c in range(12)]
    _, by_super = class_groups(torch.ones(2, 12, dtype=torch.bool), supers)
    assert by_super.tolist() == sorted(supers), "the data's super-classes when it has them"


def test_tensorboard_gets_coverage_and_the_routing_loss_once_pruned(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = L.pytorch.loggers.TensorBoardLogger(tmp_path, name="tb")
    pruning = GroupLassoPruning(threshold=0.3, start_epoch=1, every_n_steps=1)
    model = tiny_model(num_experts=4, group_lasso_weight=0.01, routing_loss_weight=1.0)
    trainer(tmp_path, [pruning], epochs=3, logger=logger, log_every_n_steps=1).fit(model, tiny_data())
    assert model.head.kept_mask().sum() < 4 * 12, "the pruning must have removed rows"
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    coverage = [e.value for e in events.Scalars("train/head/coverage")]
    routing = [e.value for e in events.Scalars("train/reg/routing")]
    assert coverage[0] == 1.0 and routing[0] == pytest.approx(0.0, abs=1e-6), "dense experts keep every target"
    assert min(coverage) < 1.0 and max(routing) > 0.0, "after pruning some targets are routed to experts without them"


def test_checkpoint_after_mitosis_and_pruning_loads_into_the_original_model(tmp_path):
    callbacks = [Mitosis(4, every_n_epochs=1), GroupLassoPruning(threshold=0.3, start_epoch=1, every_n_steps=1)]
    data = tiny_data()
    fitted = trainer(tmp_path, callbacks, epochs=2)
    model = tiny_model(group_lasso_weight=0.01)
    fitted.fit(model, data)
    assert model.head.num_experts == 4 and model.head.kept_mask().sum() < 4 * 12
    path = tmp_path / "after.ckpt"
    fitted.save_checkpoint(path)
    expected = fitted.test(model, data, verbose=False)[0]
    # a model built from the original configuration (2 dense experts) restores the structure
    restored = ClassificationTask.load_from_checkpoint(path, encoder=MLPEncoder(8, (16,)), head=tiny_head())
    assert restored.head.num_experts == 4
    assert torch.equal(restored.head.kept_mask(), model.head.kept_mask())
    assert trainer(tmp_path, [], epochs=1).test(restored, data, verbose=False)[0] == expected
    # test --ckpt_path equivalent and fit resume continue from the saved structure
    assert trainer(tmp_path, [], epochs=1).test(tiny_model(), data, ckpt_path=path, verbose=False)[0] == expected
    resumed = tiny_model(group_lasso_weight=0.01)
    trainer(tmp_path, [Mitosis(4, every_n_epochs=1)], epochs=3).fit(resumed, data, ckpt_path=path)
    assert resumed.head.num_experts == 4


def test_checkpoint_whose_structure_disagrees_with_its_weights_is_refused(tmp_path):
    model = tiny_model()
    fitted = trainer(tmp_path, [], epochs=1, limit_train_batches=1)
    fitted.fit(model, tiny_data())
    path = tmp_path / "bad.ckpt"
    fitted.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["head_structure"]["rows_per_expert"] = [11, 12]
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match="does not match its weights") as err:
        ClassificationTask.load_from_checkpoint(path, encoder=MLPEncoder(8, (16,)), head=tiny_head())
    assert "\n" not in str(err.value)


def test_apply_structure_change_is_a_no_op_without_remaps(tmp_path):
    fitted = trainer(tmp_path, [], epochs=1, limit_train_batches=1)
    model = tiny_model()
    fitted.fit(model, tiny_data())
    params = [p for g in fitted.optimizers[0].param_groups for p in g["params"]]
    apply_structure_change(fitted, [])
    assert params == [p for g in fitted.optimizers[0].param_groups for p in g["params"]]


class ReplicaChecksum(Callback):
    """After training, every rank writes a checksum of all parameters and the expert count."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        flat = torch.cat([p.detach().double().flatten() for p in pl_module.parameters()])
        digest = [float(flat.sum()), float((flat * torch.arange(flat.numel(), dtype=torch.float64)).sum())]
        with open(os.path.join(self.directory, f"rank{trainer.global_rank}.txt"), "w") as f:
            f.write(f"{pl_module.head.num_experts} {trainer.global_step} {digest[0]!r} {digest[1]!r}")


@pytest.mark.slow  # about 35 s on a loaded 2-core machine (two spawned processes)
def test_ddp_two_processes_through_mitosis_keep_replicas_identical(tmp_path):
    callbacks = [Mitosis(4, every_n_epochs=1, noise=0.05), GroupLassoPruning(0.2, start_epoch=1, every_n_steps=2),
                 LoadBalancing(), SparsityTracker(heatmap=False), ReplicaChecksum(str(tmp_path))]
    fitted = trainer(tmp_path, callbacks, epochs=2, strategy="ddp_spawn", devices=2)
    fitted.fit(tiny_model(group_lasso_weight=0.01, load_balance_weight=0.5), tiny_data())
    rank0 = (tmp_path / "rank0.txt").read_text().split()
    rank1 = (tmp_path / "rank1.txt").read_text().split()
    assert rank0[0] == "4", "mitosis happened"
    assert int(rank0[1]) > 4, "training continued after the cloning step"
    assert rank0 == rank1, f"replicas diverged: {rank0} vs {rank1}"


# ---------------------------------------------------------------------- head configs on the LM task
@pytest.mark.parametrize(
    "head_config, experts, mitosis",
    [("configs/heads/ds_softmax.yaml", 8, False), ("configs/heads/ds8.yaml", 8, True),
     ("configs/heads/ds16.yaml", 16, True), ("configs/heads/ds32.yaml", 32, True), ("configs/heads/ds64.yaml", 64, True),
     ("configs/heads/ds64_no_expert_lasso.yaml", 64, True)],
)
def test_ds_head_configs_compose_with_an_lm_config(head_config, experts, mitosis, tmp_path):
    from app.main import main
    from tests.test_cli import PTB, ROOT, TINY_LM, run_dirs, write_corpus

    data = write_corpus(tmp_path / "ptb", PTB)
    cli = main(["--config", str(ROOT / "configs/lm/ptb.yaml"), "--config", str(ROOT / head_config), *TINY_LM,
                *run_dirs(tmp_path), "--data.init_args.data_dir", str(data)], run=False)
    kinds = {type(c): c for c in cli.trainer.callbacks}
    assert {GroupLassoPruning, LoadBalancing, SparsityTracker} <= set(kinds)
    assert isinstance(cli.model.head, DSSoftmax)
    if not mitosis:
        assert cli.model.head.num_experts == experts and Mitosis not in kinds
        return
    assert kinds[Mitosis].max_experts == experts and cli.model.head.num_experts == 2
    head = cli.model.head
    if "no_expert_lasso" in head_config:  # the Eq. 6 ablation
        assert head.expert_lasso_weight == 0.0 < head.group_lasso_weight
    else:  # λ_expert = λ_lasso (§3 of the paper)
        assert head.expert_lasso_weight == head.group_lasso_weight
    # mitosis in stages: each stage pruned before it is cloned (App. B)
    pruning = kinds[GroupLassoPruning]
    assert pruning.start_epoch is None and 0 < pruning.after_cloning < kinds[Mitosis].every_n_steps
    if experts == 64:  # run one of them through two cloning steps on the real LM task
        kinds[Mitosis].every_n_steps = 1
        kinds[GroupLassoPruning].after_cloning = 0
        cli.trainer.fit(cli.model, cli.datamodule)
        assert cli.model.head.num_experts == 8  # steps 0, 1, 2 -> 2, 4, 8 experts
        assert [row["num_experts"] for row in kinds[Mitosis].memory_report] == [4.0, 8.0]


def test_analyze_experts_on_a_language_model_checkpoint(tmp_path, capsys):
    """``analyze experts`` takes an LM checkpoint too: hidden states from the task's own
    ``hidden_states``, classes named by the vocabulary, no purity (no known hierarchy)."""
    import json

    from app.main import main
    from tests.test_cli import PTB, ROOT, TINY_LM, WORDS, run_dirs, write_corpus

    data = write_corpus(tmp_path / "ptb", PTB)
    cli = main(["fit", "--config", str(ROOT / "configs/lm/ptb.yaml"), "--config", str(ROOT / "configs/heads/ds_softmax.yaml"),
                *TINY_LM, *run_dirs(tmp_path), "--data.init_args.data_dir", str(data)])
    last = str(tmp_path / "final.ckpt")
    cli.trainer.save_checkpoint(last)
    out = tmp_path / "analysis"
    timing = ["--reference_head", "softmax", "--latency_samples", "12", "--latency_batch", "4", "--latency_repeats", "1"]
    where = tmp_path / "data.yaml"  # the corpus location is the user's, never the checkpoint's
    where.write_text(f"data:\n  class_path: datamodules.TextCorpus\n  init_args:\n    data_dir: {data}\n")
    assert main(["analyze", "experts", "--ckpt_path", last, "--config", str(where), "--output_dir", str(out), *timing]) == 0
    report = json.loads((out / "experts.json").read_text())
    head = cli.model.head
    assert report["num_experts"] == head.num_experts and "purity" not in report
    assert 0 < report["coverage"] <= 1 and abs(sum(report["utilisation"]) - 1) < 1e-3
    assert report["latency"]["samples"] == 12 and report["latency"]["ds_single_ms"] > 0
    listed = {word for words in report["smallest_experts"].values() for word in words}
    assert listed and listed <= set(WORDS) | {"<unk>", "<eos>"}, "experts' classes are named by the LM's words"
    assert "flops_reduction" in capsys.readouterr().out
