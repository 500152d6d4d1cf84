"""Classification task and the App. A hierarchy data, through plain Lightning and through the
real CLI with every hierarchy / DS head config; analyze experts on the resulting checkpoint."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from app.main import main
from datamodules.hierarchy import HierarchyDataModule
from heads.ds import DSSoftmax
from tasks.callbacks import GroupLassoPruning, LoadBalancing, Mitosis, SparsityTracker
from tasks.classification import ClassificationTask
from tasks.encoders import MLPEncoder
from tests.conftest import SHRINK, TinyConfig

ROOT = Path(__file__).resolve().parent.parent

# Shrinks a hierarchy config to seconds without changing what it exercises: the shared tiny config's
# data sizes (tests/conftest.py), the config's own epochs.
TINY_HIERARCHY = [
    *SHRINK["datamodules.hierarchy.HierarchyDataModule"], "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false", "--trainer.log_every_n_steps", "1",
]
run_dirs = TinyConfig.dirs


# ---------------------------------------------------------------------- data
def test_hierarchy_sizes_are_known_before_setup_and_data_is_deterministic():
    data = HierarchyDataModule(num_super=3, num_sub=4, num_features=5, train_per_class=2)
    assert (data.num_classes, data.num_features) == (12, 5)
    assert data.super_class_of == [c // 4 for c in range(12)] and data.class_names[5] == "s1.1"
    assert not data.splits, "no data is generated in __init__"
    first = data.generate()["train"]
    again = HierarchyDataModule(num_super=3, num_sub=4, num_features=5, train_per_class=2).generate()["train"]
    assert torch.equal(first.inputs, again.inputs) and len(first) == 24
    batch = next(iter(data.train_dataloader()))
    assert batch["input"].shape[1] == 5 and batch["target"].dtype == torch.long


def test_sub_classes_cluster_around_their_super_class():
    # Eq. 7: with a small sub-class spread, a sample is nearer its own super-class centre
    data = HierarchyDataModule(num_super=4, num_sub=5, num_features=16, sigma_super=1.0, sigma_sub=0.1, sigma_input=0.1)
    train = data.generate()["train"]
    supers = torch.as_tensor(data.super_class_of)[train.targets]
    centres = torch.stack([train.inputs[supers == s].mean(0) for s in range(4)])
    nearest = torch.cdist(train.inputs, centres).argmin(1)
    assert (nearest == supers).float().mean() > 0.95


@pytest.mark.parametrize("key, value", [("num_super", 0), ("batch_size", 0), ("sigma_input", -1.0), ("num_features", 1.5)])
def test_hierarchy_bad_input_is_one_line(key, value):
    with pytest.raises(ValueError, match=key) as err:
        HierarchyDataModule(**{key: value})
    assert "\n" not in str(err.value) and "data.init_args" in str(err.value)


# ---------------------------------------------------------------------- task
def tiny(head="softmax", **kw) -> tuple[ClassificationTask, HierarchyDataModule]:
    data = HierarchyDataModule(num_super=3, num_sub=3, num_features=8, train_per_class=12, val_per_class=4,
                               test_per_class=6, batch_size=12, sigma_sub=0.8)
    model = ClassificationTask(9, MLPEncoder(8, (32,)), head, optimizer=partial(torch.optim.Adam, lr=0.02), **kw)
    return model, data


def quiet_trainer(tmp_path: Path, **kw) -> L.Trainer:
    return L.Trainer(**{"max_epochs": 4, "limit_val_batches": 0, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                        "enable_model_summary": False, "default_root_dir": tmp_path, **kw})


def test_task_learns_and_metrics_count_every_sample_once(tmp_path):
    model, data = tiny(partial(DSSoftmax, num_experts=3))
    trainer = quiet_trainer(tmp_path)
    before = trainer.test(model, data, verbose=False)[0]
    trainer.fit(model, data)
    after = trainer.test(model, data, verbose=False)[0]
    assert after["test/acc@1"] > max(0.8, before["test/acc@1"])
    assert after["test/loss"] < before["test/loss"]
    # the reported loss is the mean over all test samples (sums / count, not a mean of batch means)
    data.setup()
    model.eval()
    with torch.no_grad():
        nll = torch.cat([model.head(model(b["input"]), b["target"]) for b in data.test_dataloader()])
    assert after["test/loss"] == pytest.approx(float(nll.mean()), rel=1e-5)
    assert nll.numel() == 54


def test_predict_step_returns_top_k_classes_and_scores(tmp_path):
    model, data = tiny(predict_topk=3)
    predictions = quiet_trainer(tmp_path, max_epochs=1).predict(model, data)
    first = predictions[0]
    assert first["classes"].shape == first["log_probs"].shape == (12, 3)
    assert (first["log_probs"].diff(dim=1) <= 0).all(), "best first"
    assert "target" in first


def test_encoder_is_generic_any_module_with_out_features(tmp_path):
    class Flatten(nn.Module):  # an image-like encoder: (B, 2, 4) -> (B, 8)
        out_features = 8

        def forward(self, x):
            return x.flatten(1)

    data = HierarchyDataModule(num_super=2, num_sub=2, num_features=8, train_per_class=4, batch_size=8)
    model = ClassificationTask(4, Flatten(), "softmax", eval_topk=(1, 2), predict_topk=2)
    batch = next(iter(data.train_dataloader()))
    hidden = model(batch["input"].view(-1, 2, 4))
    assert model.head.topk(hidden, 2)[1].shape == (8, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"encoder": nn.ReLU()}, "out_features"),
     ({"num_features": 7}, "in_features: 7"),
     ({"eval_topk": (1, 50)}, "eval_topk"),
     ({"predict_topk": 0}, "predict_topk")],
)
def test_task_bad_input_is_one_line(kwargs, match):
    args = {"num_classes": 9, "encoder": MLPEncoder(8, (4,)), **kwargs}
    with pytest.raises(ValueError, match=match) as err:
        ClassificationTask(**args)
    assert "\n" not in str(err.value)


def test_mlp_encoder_bad_input():
    with pytest.raises(ValueError, match="hidden_sizes"):
        MLPEncoder(4, ())
    with pytest.raises(ValueError, match="in_features"):
        MLPEncoder(0)

def test_coverage_is_the_share_routed_to_an_expert_keeping_the_class_and_bounds_top1():
    from app.analyze.experts import expert_statistics

    class Identity(nn.Module):  # hidden states in, hidden states out: the head sees the inputs
        target_key = "target"

        def __init__(self, head):
            super().__init__()
            self.head = head

        @property
        def device(self):
            return torch.device("cpu")

        def forward(self, x):
            return x

    torch.manual_seed(0)
    head = DSSoftmax(8, 30, num_experts=4, init_std=0.5)
    head.prune(0.9)  # leaves each expert a part of the classes (every class keeps a copy)
    hidden, target = torch.randn(200, 8), torch.randint(0, 30, (200,))
    loader = [{"input": hidden[i : i + 50], "target": target[i : i + 50]} for i in range(0, 200, 50)]
    stats = expert_statistics(Identity(head), loader)
    expert, _ = head.route(hidden)
    expected = head.kept_mask()[expert, target].float().mean().item()
    assert 0 < expected < 1, "the fixture must prune some routed classes"
    assert stats["coverage"] == pytest.approx(expected)
    top1 = (head.topk(hidden, 1)[1].squeeze(1) == target).float().mean().item()
    assert top1 <= stats["coverage"]


# ---------------------------------------------------------------------- CLI + configs
def test_ds10x10_config_fit_test_and_analyze_experts(tmp_path, capsys):
    config = ["--config", str(ROOT / "configs/hierarchy/ds10x10.yaml"), *TINY_HIERARCHY, *run_dirs(tmp_path),
              "--trainer.max_epochs", "4", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
    cli = main(["fit", *config])
    head = cli.model.head
    assert isinstance(head, DSSoftmax) and head.num_experts == 10, "mitosis 5 -> 10 at epoch 3"
    assert {type(c) for c in cli.trainer.callbacks} >= {Mitosis, GroupLassoPruning, LoadBalancing, SparsityTracker}
    # Lightning 2.6 refreshes last.ckpt only with a top-k save: save the final state explicitly
    last = str(tmp_path / "final.ckpt")
    cli.trainer.save_checkpoint(last)
    fitted = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("val/")}
    # test --ckpt_path with the ORIGINAL config (5 dense experts) restores the grown structure
    tested = main(["validate", *config, "--ckpt_path", last])
    assert tested.model.head.num_experts == 10
    assert torch.equal(tested.model.head.kept_mask(), head.kept_mask())
    assert float(tested.trainer.callback_metrics["val/acc@1"]) == pytest.approx(fitted["val/acc@1"])
    assert main(["analyze", "experts", "--ckpt_path", last, "--output_dir", str(tmp_path / "analysis")]) == 0
    report = json.loads((tmp_path / "analysis" / "experts.json").read_text())
    assert report["num_experts"] == 10 and 0 <= report["purity"] <= 1 and len(report["utilisation"]) == 10
    assert (tmp_path / "analysis" / "heatmap.png").stat().st_size > 0
    assert "purity" in capsys.readouterr().out

    # head latency against a full-softmax model of the same task, and against a wrong class set
    soft = ["--config", str(ROOT / "configs/hierarchy/softmax10x10.yaml"), *TINY_HIERARCHY, "--trainer.max_epochs", "1",
            "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
    reference = main(["fit", *soft, *run_dirs(tmp_path / "softmax")]).trainer.checkpoint_callback.last_model_path
    timing = ["--latency_samples", "20", "--latency_batch", "8", "--latency_repeats", "2", "--output_dir", str(tmp_path / "lat")]
    assert main(["analyze", "experts", "--ckpt_path", last, "--reference_ckpt", reference, *timing]) == 0
    latency = json.loads((tmp_path / "lat" / "experts.json").read_text())["latency"]
    assert latency["reference_head"] == "Softmax" and latency["samples"] == 20
    assert latency["ds_single_ms"] > 0 and latency["single_speedup"] == pytest.approx(
        latency["reference_single_ms"] / latency["ds_single_ms"])
    assert "head top-1 latency" in capsys.readouterr().out
    # without a trained reference: an untrained softmax of the DS head's shape on the DS hidden states
    assert main(["analyze", "experts", "--ckpt_path", last, "--reference_head", "softmax", *timing]) == 0
    latency = json.loads((tmp_path / "lat" / "experts.json").read_text())["latency"]
    assert latency["reference_head"] == "Softmax" and not latency["reference_trained"] and latency["reference_single_ms"] > 0
    assert "(untrained, same shape)" in capsys.readouterr().out
    for bad, match in ((["--reference_head", "nope"], "'nope' is not a head"),
                       (["--reference_head", "softmax", "--reference_ckpt", reference], "pass one")):
        with pytest.raises(SystemExit):
            main(["analyze", "experts", "--ckpt_path", last, *bad])
        assert match in capsys.readouterr().err
    other = main(["fit", *soft, "--data.init_args.num_sub", "5", *run_dirs(tmp_path / "other")])
    with pytest.raises(ValueError, match="has 50 classes but .* has 100"):
        main(["analyze", "experts", "--ckpt_path", last, "--reference_ckpt", other.trainer.checkpoint_callback.last_model_path])


@pytest.mark.parametrize(
    "config", ["configs/hierarchy/softmax10x10.yaml", "configs/hierarchy/softmax100x100.yaml",
               "configs/hierarchy/ds100x100.yaml"],
)
def test_other_hierarchy_configs_run(config, tmp_path):
    shrink = ["--data.init_args.num_super", "8", "--data.init_args.num_sub", "5"] if "100x100" in config else []
    cli = main(["fit", "--config", str(ROOT / config), *TINY_HIERARCHY, *shrink, *run_dirs(tmp_path),
                "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"])
    assert cli.model.head.num_classes == cli.datamodule.num_classes
    assert "val/acc@1" in cli.trainer.callback_metrics
    if "softmax" in config:
        with pytest.raises(ValueError, match="sparse-experts interface"):
            main(["analyze", "experts", "--ckpt_path", cli.trainer.checkpoint_callback.last_model_path])


def test_ds100x100_schedule_lowers_the_lassos_stops_balancing_and_test_loads_it(tmp_path):
    """The shipped schedule, shrunk to 2 batches per epoch: from epoch 3 the group and expert
    lassos drop from 1e-4 to 3e-5, balancing stops and the routing loss starts; eight epochs end at
    the softmax baseline's learning rate; the last checkpoint carries the structure into `test`."""
    config = str(ROOT / "configs/hierarchy/ds100x100.yaml")
    shrink = [*TINY_HIERARCHY, "--data.init_args.num_super", "8", "--data.init_args.num_sub", "5",
              "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
    cli = main(["fit", "--config", config, *shrink, *run_dirs(tmp_path)])
    head = cli.model.head
    assert cli.trainer.current_epoch == 8
    assert head.group_lasso_weight == head.expert_lasso_weight == pytest.approx(3e-5)
    assert head.load_balance_weight == 0.0
    assert head.routing_loss_weight == 1.0
    assert [g["lr"] for g in cli.trainer.optimizers[0].param_groups] == [pytest.approx(3e-3 / 9, rel=1e-4)]
    last = cli.trainer.checkpoint_callback.last_model_path
    tested = main(["test", "--config", config, *shrink, *run_dirs(tmp_path / "test"), "--ckpt_path", last])
    assert tested.model.head.structure() == head.structure()
    assert "test/acc@1" in tested.trainer.callback_metrics


def test_predict_without_a_writer_callback_writes_a_csv_of_the_top_classes(tmp_path, capsys):
    """A classifier whose config has no prediction writer (the hierarchy) still gives its
    predictions: ``predictions.csv`` in the evaluation's log directory, one row per sample with
    the target, the top-k class names and their probabilities, and a line saying where."""
    import csv

    config = ["--config", str(ROOT / "configs/hierarchy/softmax10x10.yaml"), *TINY_HIERARCHY, *run_dirs(tmp_path),
              "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
    last = main(["fit", *config]).trainer.checkpoint_callback.last_model_path
    capsys.readouterr()
    predicted = main(["predict", *config, "--ckpt_path", last, "--trainer.limit_predict_batches", "2"])
    path = Path(predicted.trainer.log_dir) / "predictions.csv"
    assert f"predictions: {path}" in capsys.readouterr().out
    rows = list(csv.reader(path.open()))
    k = predicted.model.predict_topk
    assert rows[0] == ["sample", "target", *[f"class_{i + 1}" for i in range(k)], *[f"score_{i + 1}" for i in range(k)]]
    names = set(predicted.datamodule.class_names)
    assert len(rows) > 1 and all(row[1] in names and set(row[2:2 + k]) <= names for row in rows[1:])
    assert all(0 <= float(score) <= 1 for row in rows[1:] for score in row[2 + k:])
