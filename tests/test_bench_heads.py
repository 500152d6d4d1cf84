"""``bench heads`` at tiny sizes: it runs every variant in one process, prints ratios (to
softmax, to the reference, evaluation to training, compiled to eager), counts FLOPs (the MoS
fast path does no more matmul work than the reference), probes memory in a fresh process, and
refuses bad arguments."""

from __future__ import annotations

import json

import pytest

from app.bench.heads import Case, Sizes, all_variants, count_flops, main, measure_memory_in_subprocess
from tests.shell import run_cli

TINY = ["--tiny", "--threads", "1"]


def test_tiny_run_prints_every_variant_with_ratios(tmp_path, capsys):
    out_file = tmp_path / "bench.json"
    assert main([*TINY, "--no-memory", "--json", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "measured fp32 matmul peak" in out
    assert "| eval (ms) | eval / fwd+bwd |" in out
    for name in all_variants():
        assert f"| {name} |" in out
    assert "| softmax |" in out and "1.00x" in out
    result = json.loads(out_file.read_text())
    assert set(result["rows"]) == set(all_variants())
    assert all(row["seconds"] > 0 and row["flops"] > 0 and row["eval_seconds"] > 0 for row in result["rows"].values())
    assert all(row["compiled_seconds"] is None for row in result["rows"].values())
    assert result["matmul_peak_flops"] > 0


def test_compiled_and_eval_columns_from_the_shell(tmp_path):
    """``python -m app bench heads --compile`` times the compiled step in the same rounds as eager and
    prints its ratio to eager, and the evaluation forward with its ratio to forward+backward."""
    out_file = tmp_path / "bench.json"
    done = run_cli(["bench", "heads", *TINY, "--no-memory", "--repeats", "1", "--heads", "softmax", "--compile", "--json", str(out_file)])
    assert done.returncode == 0, done.stderr[-2000:]
    header = next(line for line in done.stdout.splitlines() if line.startswith("| head |"))
    cells = dict(zip(header.split("|"), next(line for line in done.stdout.splitlines() if line.startswith("| softmax |")).split("|")))
    assert cells[" compiled / eager "].strip().endswith("x") and cells[" eval / fwd+bwd "].strip().endswith("x"), done.stdout
    row = json.loads(out_file.read_text())["rows"]["softmax"]
    assert row["compiled_seconds"] > 0 and row["compile_seconds"] > 0 and 0 < row["eval_seconds"]


def test_mos_fast_path_does_no_more_matmul_work_than_the_reference():
    """The fused pass does the minimum three decoder matmuls, like the reference (no
    recomputation), and Mixtape's gate sharing does far less than dense per-token gates."""
    sizes = Sizes(tokens=32, hidden=12, dim=8, vocab=300, components=4, gates=4, gate_dim=4, frequent_fraction=0.1)
    flops = {name: count_flops(Case(name, sizes)) for name in all_variants()}
    assert flops["mos"] <= flops["mos-reference"]
    assert flops["mos"] >= 3 * 2 * sizes.tokens * sizes.components * sizes.dim * sizes.vocab
    assert flops["mixtape"] < 0.6 * flops["mixtape-reference"]


@pytest.mark.slow  # a fresh interpreter: a process's allocator keeps what earlier tests freed
def test_memory_probe_sees_the_references_n_k_v_tensors():
    """The probe (in a fresh process, as the bench runs it) sees the reference's several (N, K, V)
    float32 tensors of 41 MiB (above glibc's largest mmap threshold, so each is a fresh mapping
    the high-water mark must see)."""
    sizes = Sizes(tokens=64, hidden=16, dim=8, vocab=20000, components=8, gates=4, gate_dim=4, frequent_fraction=0.1)
    block = 64 * 8 * 20000 * 4
    assert measure_memory_in_subprocess("mos-reference", sizes, threads=1) >= 2 * block


@pytest.mark.slow
def test_memory_probe_in_fresh_processes_mos_needs_far_less_than_reference(capsys):
    args = ["--threads", "1", "--tokens", "64", "--hidden", "16", "--dim", "8", "--vocab", "20000",
            "--components", "8", "--repeats", "1", "--heads", "mos,mos-reference"]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    header = [cell.strip() for cell in next(line for line in out if line.startswith("| head |")).split("|")]
    column = header.index("peak mem (MiB)")  # found by name: the table gains columns (eval, compiled)
    lines = {line.split("|")[1].strip(): line for line in out if line.startswith("| mos")}
    memory = {name: float(line.split("|")[column]) for name, line in lines.items()}
    assert memory["mos-reference"] >= 2 * 39  # MiB: at least two (N, K, V) float32 tensors
    assert memory["mos"] < 0.35 * memory["mos-reference"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--heads", "softmax,nope"], "unknown head 'nope' in --heads: valid are softmax, adaptive_softmax, moc, mos, mos-reference, "
                                      "mixtape, mixtape-reference, sigsoftmax"),
        (["--gates", "3", "--heads", "mixtape"], "power of two >= 2, got 3"),
    ],
)
def test_bad_arguments_return_2_with_a_message(args, message, capsys):
    assert main([*TINY, "--no-memory", *args]) == 2
    assert message in capsys.readouterr().err


def test_non_positive_sizes_are_refused():
    with pytest.raises(SystemExit):
        main(["--tokens", "0", "--no-memory"])
