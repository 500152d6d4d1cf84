"""``bench train`` at tiny sizes: the tables have their columns, every ratio and rate is computed
from the measured values of the same run, the budget search finds the largest fitting batch,
the memory probe sees a bigger batch, and bad arguments are refused."""

from __future__ import annotations

import csv
import json

import pytest

from app.bench.train import COLUMNS, PRESETS, Workload, largest_batch, main, parse_args

TINY = ["--tiny", "--threads", "1", "--warmup", "0"]


def read(tmp_path, name: str) -> tuple[list[dict], dict]:
    rows = list(csv.DictReader(open(tmp_path / f"{name}.csv")))
    return rows, json.loads((tmp_path / f"{name}.json").read_text())


def test_lm_run_tables_and_ratios_come_from_measured_values(tmp_path, capsys):
    heads = "softmax,mixtape,mos:2,ds_softmax:4"
    args = [*TINY, "--heads", heads, "--csv", str(tmp_path / "lm.csv"), "--json", str(tmp_path / "lm.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| head | output layer ms | vs softmax | whole network ms | vs softmax | output share | peak MiB" in out
    assert "| head | largest batch (sequences) | step ms | ms per instance | vs softmax |" in out
    assert "measured fp32 matmul peak" in out
    rows, result = read(tmp_path, "lm")
    assert list(rows[0]) == ["preset", *COLUMNS]
    assert [r["head"] for r in rows] == heads.split(",")
    base = {key: float(rows[0][key]) for key in COLUMNS[1:]}
    peak = result["matmul_peak_gflops"]
    assert peak > 0
    for r in rows:
        v = {key: float(r[key]) for key in COLUMNS[1:]}
        assert v["output_ms"] > 0 and v["whole_ms"] > 0 and v["peak_mib"] > 0 and v["budget_batch"] >= 1
        assert v["output_min_ms"] <= v["output_ms"] <= v["output_max_ms"]
        assert v["output_vs_softmax"] == pytest.approx(v["output_ms"] / base["output_ms"])
        assert v["whole_vs_softmax"] == pytest.approx(v["whole_ms"] / base["whole_ms"])
        assert v["peak_vs_softmax"] == pytest.approx(v["peak_mib"] / base["peak_mib"])
        assert v["budget_ms_per_instance"] == pytest.approx(v["budget_step_ms"] / v["budget_batch"])
        assert v["budget_vs_softmax"] == pytest.approx(v["budget_ms_per_instance"] / base["budget_ms_per_instance"])
        assert v["output_share"] == pytest.approx(v["output_ms"] / v["whole_ms"])
        assert v["output_gflops"] == pytest.approx(v["output_gflop"] / (v["output_ms"] / 1e3))
        assert v["whole_pct_peak"] == pytest.approx(100 * v["whole_gflops"] / peak)
        # the whole network does the head's work and the encoder's
        assert v["whole_gflop"] > v["output_gflop"] > 0
    assert float(rows[2]["output_gflop"]) > 1.5 * float(rows[0]["output_gflop"])  # MoS-2 does K softmaxes


def test_translation_preset_runs_the_transformer(tmp_path, capsys):
    args = [*TINY, "--preset", "wmt", "--heads", "softmax,sigsoftmax", "--no-budget", "--repeats", "1",
            "--csv", str(tmp_path / "mt.csv"), "--json", str(tmp_path / "mt.json")]
    assert main(args) == 0
    assert "preset wmt: transformer" in capsys.readouterr().out
    rows, result = read(tmp_path, "mt")
    assert result["sizes"]["model"] == "transformer" and len(rows) == 2
    assert rows[0]["budget_batch"] == "" and float(rows[1]["whole_gflop"]) > 0


def affine_probe(spec, preset, batch, redundancy):
    return 100 + 10 * batch


def test_budget_search_finds_the_largest_fitting_batch():
    preset = PRESETS["ptb"]
    assert largest_batch("softmax", preset, 255, 1.5, 1000, probe=affine_probe) == (15, 250)
    assert largest_batch("softmax", preset, 255, 1.5, 8, probe=affine_probe) == (8, 180)
    assert largest_batch("softmax", preset, 50, 1.5, 8, probe=affine_probe) == (0, 110)

    def convex(spec, preset, batch, redundancy):  # the affine fit overshoots: the search must shrink
        return 100 + 10 * batch + batch**2

    assert largest_batch("softmax", preset, 400, 1.5, 1000, probe=convex) == (13, 399)  # 14 needs 436


def test_static_bytes_count_parameters_and_momentum():
    preset = parse_args(["--tiny"]).preset_sizes
    work = Workload("softmax", preset, 2, 1.5, output=False)
    params = sum(p.numel() * 4 for p in work.model.parameters())
    assert work.static_bytes() >= params


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--heads", "softmax,nope"], "unknown head 'nope' in --heads: valid are softmax, adaptive_softmax, moc, mos, mixtape, "
                                      "sigsoftmax, ds_softmax (optionally name:K, e.g. mos:15)"),
        (["--heads", "mos:x"], "positive integer K"),
        (["--heads", "softmax:3"], "softmax takes no K"),
        (["--heads", "mixtape:3"], "power of two >= 2, got 3"),
        (["--heads", "ds_softmax:4", "--ds-redundancy", "5"], "1 <= ds redundancy <= K=4, got 5.0"),
    ],
)
def test_bad_heads_return_2_with_a_message(args, message, capsys):
    assert main([*TINY, *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [["--repeats", "0"], ["--budget", "0"], ["--batch", "-1"], ["--heads", ","], ["--no-budget", "--no-same-batch"]],
)
def test_bad_numbers_are_refused(args):
    with pytest.raises(SystemExit):
        parse_args(args)


def test_budget_table_alone(tmp_path, capsys):
    args = [*TINY, "--heads", "softmax,mixtape", "--no-same-batch", "--csv", str(tmp_path / "b.csv"),
            "--json", str(tmp_path / "b.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Same batch size" not in out and "Same memory budget" in out
    rows, _ = read(tmp_path, "b")
    assert rows[0]["output_ms"] == "" and float(rows[1]["budget_vs_softmax"]) == pytest.approx(
        float(rows[1]["budget_ms_per_instance"]) / float(rows[0]["budget_ms_per_instance"]))


@pytest.mark.slow  # a fresh interpreter per probe
def test_isolated_memory_probe_runs_in_a_fresh_process_and_sees_the_batch():
    from app.bench.train import isolated_peak_bytes

    preset = parse_args(["--tiny", "--length", "20"]).preset_sizes
    preset.vocab = 20000
    small, large = (isolated_peak_bytes("softmax", preset, b, 1.5) for b in (1, 16))
    assert large - small > 5 * 20 * 20000 * 4
