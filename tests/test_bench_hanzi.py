"""``bench hanzi`` at tiny sizes: one row per variant in order, every ratio computed from the
same run's measured times, FLOPs counted (a stride-2 stem does less work than stride 1), and bad
variant strings refused with the rule."""

from __future__ import annotations

import json

import pytest

from app.bench.hanzi import Variant, main

TINY = ["--num_classes", "20", "--batch_size", "4", "--features", "16", "--threads", "1", "--warmup", "0", "--repeats", "2"]


def test_rows_ratios_and_flops_come_from_the_run(tmp_path, capsys):
    variants = "8-16:1:1:32,8-16:1:2:32"
    assert main([*TINY, "--variants", variants, "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "| channels:blocks:stem:input | step ms (min-max) | images/s | vs first |" in out
    result = json.loads((tmp_path / "b.json").read_text())
    rows = result["rows"]
    assert [r["name"] for r in rows] == variants.split(",")
    assert result["matmul_peak_gflops"] > 0
    for r in rows:
        assert r["min_ms"] <= r["step_ms"] <= r["max_ms"]
        assert r["images_per_s"] == pytest.approx(4 / (r["step_ms"] / 1e3))
        assert r["vs_first"] == pytest.approx(r["images_per_s"] / rows[0]["images_per_s"])
        assert r["gflop_per_s"] == pytest.approx(r["gflop_per_step"] / (r["step_ms"] / 1e3))
        assert f"| {r['name']} |" in out
    assert 0 < rows[1]["gflop_per_step"] < rows[0]["gflop_per_step"]  # stride-2 stem: stages at half resolution


@pytest.mark.parametrize("text", ["32-64:1:3:64", "32-64:1:2", "a-b:1:1:64", "32-64:0:1:64"])
def test_bad_variant_is_refused_with_the_rule(text):
    with pytest.raises(ValueError, match="channels:blocks:stem:input"):
        Variant.parse(text)
