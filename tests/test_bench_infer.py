"""``bench infer`` at tiny sizes: the table has its columns, every speed-up and FLOPs reduction is
computed from this run's measured medians, agreements are measured against the full softmax
(the adaptive softmax, trained on frequency-ranked ids, answers in the data's ids), and the DS-Softmax fitted to the softmax routes like its k-means gate and keeps the calibration
contexts' top classes."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from app.bench.infer import COLUMNS, ds_from_softmax, make_hierarchy, main, parse_args, spherical_kmeans, train_softmax


def test_tiny_run_columns_and_ratios_from_measured_values(tmp_path, capsys):
    out_csv, out_json = tmp_path / "infer.csv", tmp_path / "infer.json"
    args = ["--tiny", "--threads", "1", "--train-threads", "1", "--warmup", "0", "--candidates", "0.05,30",
            "--csv", str(out_csv), "--json", str(out_json)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| method | top-1 ms/ctx (min-max) | speed-up | top-k ms/ctx | speed-up | batch ms |" in out
    rows = list(csv.DictReader(open(out_csv)))
    assert list(rows[0]) == COLUMNS
    names = [r["method"] for r in rows]
    assert names == ["full softmax", "adaptive_softmax", "DS-8", "SVD-5 N=15", "SVD-5 N=30", "SVD-10 N=15", "SVD-10 N=30"]
    base = {k: float(rows[0][k]) for k in COLUMNS[1:]}
    assert base["top1_agreement"] == base["topk_agreement"] == 1.0
    for r in rows:
        v = {k: float(r[k]) for k in COLUMNS[1:]}
        assert v["top1_single_ms"] > 0 and v["batch_ms"] > 0
        assert v["top1_single_min_ms"] <= v["top1_single_ms"] <= v["top1_single_max_ms"]
        assert v["top1_single_speedup"] == pytest.approx(base["top1_single_ms"] / v["top1_single_ms"])
        assert v["topk_single_speedup"] == pytest.approx(base["topk_single_ms"] / v["topk_single_ms"])
        assert v["batch_speedup"] == pytest.approx(base["batch_ms"] / v["batch_ms"])
        assert v["flops_reduction"] == pytest.approx(base["flops_per_context"] / v["flops_per_context"])
        assert 0.0 <= v["top1_agreement"] <= 1.0 and 0.0 <= v["topk_agreement"] <= 1.0
    setting = json.loads(out_json.read_text())["setting"]
    assert 0 < setting["ds_sparsity"] < 1 and setting["train_nll"] > 0 and setting["ranked_train_nll"]["adaptive_softmax"] > 0


def test_ds_fitted_to_a_softmax_routes_like_kmeans_and_keeps_calibration_top_classes():
    torch.manual_seed(0)
    data = make_hierarchy(d=12, V=200, topics=8, classes_per_topic=10, seed=0)
    softmax, _ = train_softmax(data, 12, 200, steps=20, batch=64, seed=0)
    calibration, _ = data.sample(600, torch.Generator().manual_seed(1))
    ds = ds_from_softmax(softmax, calibration, K=4, keep_topk=3, seed=0)
    centroids = spherical_kmeans(calibration, 4, 10, torch.Generator().manual_seed(0))
    expert, _ = ds.route(calibration)
    assert torch.equal(expert, (calibration @ centroids.T).argmax(1))
    # On the calibration contexts the expert holds each context's softmax top-3: exact agreement.
    with torch.no_grad():
        expected = softmax.topk(calibration, 3)[1]
        assert torch.equal(ds.topk(calibration, 3)[1], expected)
    assert ds.rows_per_expert().sum() < 4 * 200  # pruned


@pytest.mark.parametrize(
    "args",
    [["--samples", "0"], ["--preview-fractions", "0"], ["--preview-fractions", "a"], ["--num-experts", "0"],
     ["--k", "20000"], ["--num-experts", "300", "--calibration", "100"]],
)
def test_bad_arguments_are_refused(args):
    with pytest.raises(SystemExit):
        parse_args(args)
