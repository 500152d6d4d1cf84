"""``bench ds --softmax_ckpt``: the post-processing baselines on a trained model's own contexts.

What is proved (nothing here is timed): the FAISS index answers the softmax's exact top-k because
the bias is folded in as one more dimension, also where the bias alone decides; the command
prints every row and column for a tiny trained language model of the shared tiny configuration
(tests/conftest.py), the exact rows agreeing with the exact answer; a missing ``faiss`` is one
line naming the extra and the FAISS rows are left out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from app.bench.ds import ANN_EXTRA, INDEX_KINDS, InnerProductIndex, PlainSoftmax, import_faiss
from heads.softmax import Softmax
from tests.shell import run_cli

LM = "configs/lm/synthetic.yaml"


def bias_decided_softmax(d: int = 4, V: int = 20) -> Softmax:
    """Small class embeddings of similar length and a spread-out bias: the bias picks the top classes."""
    head = Softmax(d, V).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.decoder.weight.copy_(0.3 * torch.randn(V, d, generator=generator))
        head.decoder.bias.copy_(3.0 * torch.randn(V, generator=generator))
    return head


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_the_index_with_the_bias_folded_in_answers_the_exact_top_k_where_the_bias_decides(kind):
    faiss = pytest.importorskip("faiss")
    head = bias_decided_softmax()
    hidden = torch.randn(64, 4)
    exact = PlainSoftmax(head).topk(hidden, 3)[1]
    assert torch.equal(exact, head.log_prob(hidden).topk(3)[1])
    index = InnerProductIndex(faiss, head, kind, M=8, ef_construction=64, ef_search=64)
    logits, indices = index.topk(hidden, 3)
    assert torch.equal(indices, exact), f"{int((indices != exact).any(1).sum())} of 64 contexts differ"
    torch.testing.assert_close(logits, torch.addmm(head.decoder.bias, hidden, head.decoder.weight.t()).gather(1, exact))
    # the case is one where the bias decides: the embeddings alone rank other classes first
    without_bias = Softmax(4, 20, bias=False).eval()
    without_bias.decoder.weight = head.decoder.weight
    assert not torch.equal(InnerProductIndex(faiss, without_bias, kind, M=8, ef_search=64).topk(hidden, 3)[1], exact)
    assert index.memory_bytes > 20 * 5 * 4 and index.build_seconds >= 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A tiny softmax language model fitted with the shared tiny configuration, and the DS-Softmax
    checkpoint ``convert ds`` screens from it (standing in for a trained DS checkpoint of the same data)."""
    from tests.conftest import TinyConfig

    directory = tmp_path_factory.mktemp("baselines")
    fitted = run_cli(["fit", *TinyConfig().args(LM, directory=directory)], directory)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    lm = next(directory.rglob("last.ckpt"))
    ds = directory / "ds.ckpt"
    converted = run_cli(["convert", "ds", "--ckpt_path", str(lm), "--num_experts", "2", "--min_count", "1",
                         "--max_tokens", "2000", "--output", str(ds)], directory)
    assert converted.returncode == 0, converted.stderr[-3000:]
    return {"lm": lm, "ds": ds}


#: Few contexts and one timing round: the table's shape is tested, not its times.
QUICK = ["--samples", "3", "--batches", "1", "--batch_size", "8", "--repeats", "1", "--warmup", "0", "--contexts", "120"]


def table_rows(out: str) -> dict[str, list[str]]:
    """The printed table's rows by method: the cells after the method's name."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| method"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_the_comparison_prints_every_row_and_column(checkpoints, tmp_path):
    faiss_rows = ["HNSW inner product (faiss, M=32, efSearch=128)", "HNSW L2 after the MIPS transform (faiss, M=32, efSearch=128)",
                  "FAISS IndexFlatIP (exact scan)"] if import_faiss() else []
    done = run_cli(["bench", "ds", "--softmax_ckpt", str(checkpoints["lm"]), "--ckpt_path", str(checkpoints["ds"]), "--flat_ip",
                    "--screen_experts", "2", "--screen_flops_reduction", "1.2", "--screen_tokens", "2000", *QUICK], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    header = next(line for line in done.stdout.splitlines() if line.startswith("| method"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == [
        "method", "top-1 agree", "top-5 agree", "acc@1", "one context µs", "speed-up", "batch of 8 ms", "speed-up", "note"]
    rows = table_rows(done.stdout)
    svd = next(name for name in rows if name.startswith("SVD-softmax"))
    assert list(rows) == ["exact softmax (Softmax.topk)", "yardstick: gemv/gemm + max + logsumexp", svd, *faiss_rows,
                          "DS-2 screened (convert ds)", "DS-2 trained"]
    exact_rows = ["exact softmax (Softmax.topk)", "yardstick: gemv/gemm + max + logsumexp", *faiss_rows[2:]]
    for name in exact_rows:
        assert rows[name][:2] == ["100.00%", "100.00%"], (name, rows[name])
    accuracy = rows["exact softmax (Softmax.topk)"][2]
    assert all(rows[name][2] == accuracy for name in exact_rows), "the same answers score the same accuracy"
    assert rows["exact softmax (Softmax.topk)"][4] == "1.00x" and rows["exact softmax (Softmax.topk)"][6] == "1.00x"
    assert "FLOPs reduction" in rows["DS-2 screened (convert ds)"][7] and "its own encoder" in rows["DS-2 trained"][7]
    assert "exact softmax / yardstick time: one context" in done.stdout and "120 tokens" in done.stdout
    for name in faiss_rows[:2]:
        assert "build" in rows[name][7] and "MiB" in rows[name][7]


def test_a_missing_faiss_is_one_line_naming_the_extra(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # import faiss raises ImportError
    assert import_faiss() is None
    done = run_cli(["bench", "ds", "--softmax_ckpt", str(checkpoints["lm"]), "--screened_ckpt", str(checkpoints["ds"]),
                    "--json", str(tmp_path / "out.json"), *QUICK], tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "faiss" in line.lower()]
    assert lines == [f"FAISS rows skipped: faiss is not installed ({ANN_EXTRA})"]
    assert "pip install -e .[ann]" in lines[0]
    assert "DS-2 screened (convert ds)" in table_rows(done.stdout) and (tmp_path / "out.json").exists()


def test_a_checkpoint_of_another_head_is_one_line(checkpoints, tmp_path):
    done = run_cli(["bench", "ds", "--softmax_ckpt", str(checkpoints["ds"]), *QUICK], tmp_path)
    assert done.returncode == 2 and "needs a checkpoint whose head is a full softmax (heads.Softmax), got DSSoftmax" in done.stderr
    done = run_cli(["bench", "ds", "--softmax_ckpt", str(checkpoints["lm"]), "--ckpt_path", str(checkpoints["lm"]), "--screen_experts", "0",
                    *QUICK], tmp_path)
    assert done.returncode == 2 and "is not a DS-Softmax checkpoint of the same task and data" in done.stderr


def test_rotated_times_turns_the_order_every_round_and_records_each_step_once_per_round():
    from app.bench.ds import rotated_times

    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = rotated_times(steps, warmup=1, repeats=3)
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert calls == list("abc" "abc" "bca" "cab"), "one warm-up round, then each round starts one place later"
