"""A DS-Softmax structure screened from a trained softmax (heads/ds/screening.py, `convert ds`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heads.ds import DSSoftmax
from heads.ds.kmeans import nearest, spherical_kmeans
from heads.ds.screening import kept_mask, screen_softmax


def clustered_contexts(n: int = 900, d: int = 8, directions: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Contexts around a few random directions (random lengths) and the direction of each."""
    g = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(directions, d, generator=g), dim=1)
    which = torch.randint(directions, (n,), generator=g)
    lengths = 1 + 3 * torch.rand(n, 1, generator=g)
    return lengths * (centres[which] + 0.1 * torch.randn(n, d, generator=g)), which


def screened(flops=None, min_count=1.0, top=3, experts=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    V, d = 30, 8
    weight, bias = torch.randn(V, d, generator=g), 0.5 * torch.randn(V, generator=g)
    hidden, _ = clustered_contexts(d=d, seed=seed)
    targets = F.linear(hidden, weight, bias).argmax(1)  # a "language" the softmax fits
    head, report = screen_softmax(weight, bias, hidden, targets, experts, flops, None if flops else min_count, top,
                                  generator=torch.Generator().manual_seed(1))
    return head, report, weight, bias, hidden, targets


def test_spherical_kmeans_finds_the_directions_and_uses_every_cluster():
    points, which = clustered_contexts(directions=3)
    centroids = spherical_kmeans(points, 3, generator=torch.Generator().manual_seed(0))
    assignment, _ = nearest(F.normalize(points, dim=1), centroids)
    # every true direction maps to one cluster and every cluster to one direction
    pairs = set(zip(which.tolist(), assignment.tolist()))
    assert len(pairs) == 3 and len({a for _, a in pairs}) == 3
    assert torch.allclose(centroids.norm(dim=1), torch.ones(3))
    # more clusters than directions: still all of them in use (re-seeded when one empties)
    many = spherical_kmeans(points, 12, generator=torch.Generator().manual_seed(0))
    used, _ = nearest(F.normalize(points, dim=1), many)
    assert used.unique().numel() == 12


def test_screened_head_scores_its_kept_classes_exactly_like_the_softmax():
    head, report, weight, bias, hidden, _ = screened(min_count=2.0)
    head.eval()
    assert head.gate_scale == "unit" and not head.pruned_in_softmax and head.num_experts == 4
    dense = F.linear(hidden, weight, bias)  # (N, V)
    expert, _ = head.route(hidden)
    mask = head.kept_mask()
    restricted = dense.masked_fill(~mask[expert], float("-inf"))
    values, indices = head.topk(hidden, 5)
    want_values, want_indices = torch.log_softmax(restricted, 1).topk(5, dim=1)
    assert torch.equal(indices, want_indices)
    assert torch.allclose(values, want_values, atol=1e-5)
    # the gate routes to the most similar centroid, as the screening counted
    assert torch.equal(expert, nearest(F.normalize(hidden, dim=1), head.gate_weight)[0])
    assert report["kept_fraction"] == pytest.approx(float(mask.float().mean()))


def test_every_class_and_expert_kept_and_threshold_is_the_smallest_reaching_the_target():
    head, report, weight, bias, hidden, targets = screened(flops=2.5, top=5)
    mask = head.kept_mask()
    assert bool((mask.sum(0) >= 1).all()) and bool((mask.sum(1) >= 1).all())
    assert report["flops_reduction"] >= 2.5 and report["threshold"] > 1
    looser, looser_report, *_ = screened(min_count=report["threshold"] - 1, top=5)  # one count less keeps too much
    assert looser_report["flops_reduction"] < 2.5
    # keeping everything (a class counted wherever it is in the top V) is the full softmax
    full, full_report, *_ = screened(top=30)
    assert bool(full.kept_mask().all()) and full_report["flops_reduction"] == pytest.approx(1.0)
    full.eval()
    assert torch.allclose(full.log_prob(hidden), torch.log_softmax(F.linear(hidden, weight, bias), 1), atol=1e-5)


def test_bad_screening_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="flops_reduction > 1, got 1.0"):
        screened(flops=1.0)
    with pytest.raises(ValueError, match="cannot reach flops_reduction 50 with 4 experts"):
        screened(flops=50)
    with pytest.raises(ValueError, match="min_count >= 1, got 0.5"):
        screened(min_count=0.5)
    with pytest.raises(ValueError, match="exactly one of"):
        screen_softmax(torch.randn(5, 2), None, torch.randn(4, 2), torch.zeros(4, dtype=torch.long), 2, 2.0, 1.0)
    head = DSSoftmax(4, 6, num_experts=2)
    with pytest.raises(ValueError, match="ascending and distinct"):
        head.set_experts(torch.randn(2, 4), torch.randn(3, 4), torch.tensor([2, 1, 0]), torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match="non-empty experts"):
        head.set_experts(torch.randn(2, 4), torch.randn(3, 4), torch.tensor([0, 1, 2]), torch.tensor([0, 3, 3]))


def test_kept_mask_keeps_home_and_each_experts_best_class():
    counts = torch.tensor([[5.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    mask = kept_mask(counts, home=torch.tensor([0, 1, 1]), tau=3)
    assert mask.tolist() == [[True, False, False], [False, True, True]]


def test_convert_ds_cli_round_trip_and_bad_input(tmp_path, capsys):
    """A tiny softmax LM through the real CLI: `convert ds` writes a checkpoint that `test` loads
    from the task config + configs/heads/ds_screened.yaml; keeping every class reproduces the
    softmax's test metrics exactly; bad input leaves nothing behind."""
    from app.main import main
    from tasks import LanguageModel
    from tests.test_cli import PTB, ROOT, TINY_LM, run_dirs, write_corpus

    data = write_corpus(tmp_path / "ptb", PTB)
    common = ["--config", str(ROOT / "configs/lm/ptb.yaml"), *TINY_LM, "--data.init_args.data_dir", str(data)]
    cli = main(["fit", *common, *run_dirs(tmp_path)])
    softmax_ckpt = str(tmp_path / "softmax.ckpt")
    cli.trainer.save_checkpoint(softmax_ckpt)
    V = cli.model.head.num_classes
    reference = main(["test", *common, *run_dirs(tmp_path / "ref"), "--ckpt_path", softmax_ckpt]).trainer.callback_metrics
    # where the corpus is: the user's config, never the checkpoint's (app/checkpoint_io/policy.py)
    where = tmp_path / "data.yaml"
    where.write_text(f"data:\n  class_path: datamodules.TextCorpus\n  init_args:\n    data_dir: {data}\n")

    out = tmp_path / "out" / "ds.ckpt"
    assert main(["convert", "ds", "--config", str(where), "--ckpt_path", softmax_ckpt, "--num_experts", "3", "--min_count", "1", "--top", str(V),
                 "--output", str(out)]) == 0
    assert "3 experts, FLOPs reduction 1.00x" in capsys.readouterr().out
    model = LanguageModel.load_from_checkpoint(str(out), map_location="cpu")
    assert isinstance(model.head, DSSoftmax) and model.head.num_experts == 3 and model.head.gate_scale == "unit"
    screened_cli = main(["test", *common, "--config", str(ROOT / "configs/heads/ds_screened.yaml"), *run_dirs(tmp_path / "ds"),
                         "--ckpt_path", str(out)])
    assert isinstance(screened_cli.model.head, DSSoftmax)
    metrics = screened_cli.trainer.callback_metrics
    for key in ("test/acc@1", "test/acc@5", "test/loss"):
        assert float(metrics[key]) == pytest.approx(float(reference[key]), abs=1e-5), key

    sparse = tmp_path / "sparse.ckpt"
    assert main(["convert", "ds", "--config", str(where), "--ckpt_path", softmax_ckpt, "--num_experts", "4", "--flops_reduction", "2",
                 "--output", str(sparse)]) == 0
    assert LanguageModel.load_from_checkpoint(str(sparse), map_location="cpu").head.kept_mask().float().mean() <= 0.5

    with pytest.raises(ValueError, match="needs a checkpoint whose head is a full softmax .* got DSSoftmax"):
        main(["convert", "ds", "--config", str(where), "--ckpt_path", str(out), "--output", str(tmp_path / "again.ckpt")])
    with pytest.raises(ValueError, match="is the input checkpoint"):
        main(["convert", "ds", "--config", str(where), "--ckpt_path", softmax_ckpt, "--output", softmax_ckpt])
    with pytest.raises(ValueError, match="cannot reach flops_reduction 500"):
        main(["convert", "ds", "--config", str(where), "--ckpt_path", softmax_ckpt, "--num_experts", "2", "--flops_reduction", "500",
              "--output", str(tmp_path / "never.ckpt")])
    assert not (tmp_path / "never.ckpt").exists() and not (tmp_path / "again.ckpt").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ds.ckpt"], "no temporary file left"


def test_save_verified_leaves_nothing_when_the_checkpoint_does_not_load(tmp_path):
    from app.convert.ds import save_verified

    class Unloadable:
        def __init__(self):
            raise ValueError("does not load")

    target = tmp_path / "ds.ckpt"
    target.write_bytes(b"old")
    with pytest.raises(ValueError, match="does not load"):
        save_verified({"state_dict": {}}, Unloadable, str(target))
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["ds.ckpt"]


def test_convert_ds_on_a_classification_checkpoint(tmp_path):
    """The hierarchy's softmax baseline through `convert ds` and `test` with
    configs/heads/ds_screened_classifier.yaml: with every class kept the test metrics are the
    softmax's; with a FLOPs target they come from the sparse path."""
    from app.main import main
    from tasks.classification import ClassificationTask
    from tests.test_classification import ROOT, TINY_HIERARCHY, run_dirs

    soft = ["--config", str(ROOT / "configs/hierarchy/softmax10x10.yaml"), *TINY_HIERARCHY, "--trainer.max_epochs", "2"]
    fitted = main(["fit", *soft, *run_dirs(tmp_path / "softmax")])
    softmax_ckpt = fitted.trainer.checkpoint_callback.last_model_path
    reference = main(["test", *soft, *run_dirs(tmp_path / "ref"), "--ckpt_path", softmax_ckpt]).trainer.callback_metrics
    config = [*soft, "--config", str(ROOT / "configs/heads/ds_screened_classifier.yaml")]
    full, sparse = str(tmp_path / "full.ckpt"), str(tmp_path / "sparse.ckpt")
    assert main(["convert", "ds", "--ckpt_path", softmax_ckpt, "--num_experts", "10", "--min_count", "1", "--top", "100",
                 "--output", full]) == 0
    tested = main(["test", *config, *run_dirs(tmp_path / "full"), "--ckpt_path", full]).trainer.callback_metrics
    assert float(tested["test/acc@1"]) == pytest.approx(float(reference["test/acc@1"]))
    assert main(["convert", "ds", "--ckpt_path", softmax_ckpt, "--num_experts", "10", "--flops_reduction", "4",
                 "--output", sparse]) == 0
    head = ClassificationTask.load_from_checkpoint(sparse, map_location="cpu").head
    assert isinstance(head, DSSoftmax) and head.num_experts == 10 and float(head.kept_mask().float().mean()) <= 0.25
    assert 0 <= float(main(["test", *config, *run_dirs(tmp_path / "sparse"), "--ckpt_path", sparse]).trainer.callback_metrics["test/acc@1"]) <= 1


def test_a_missing_checkpoint_is_a_one_line_error(tmp_path):
    from app.main import main

    missing = str(tmp_path / "nope.ckpt")
    for command in (["convert", "ds", "--output", str(tmp_path / "out.ckpt")], ["analyze", "experts"]):
        with pytest.raises(ValueError, match=r"checkpoint .*nope.ckpt does not exist: pass the path of a .ckpt file"):
            main([*command, "--ckpt_path", missing])
    assert not (tmp_path / "out.ckpt").exists()
