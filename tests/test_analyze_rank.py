"""``analyze rank``: empirical rank with its tolerance, singular-value CDF and expected pairwise
KL on constructed matrices, then the CLI on a saved matrix and on a real LM checkpoint."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from app.analyze.rank import (
    empirical_rank,
    expected_pairwise_kl,
    head_bound,
    main,
    singular_value_cdf,
)
from heads import MixtureOfSoftmaxes, Softmax


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("rank", [1, 3, 7])
def test_rank_of_a_constructed_low_rank_matrix(rank):
    torch.manual_seed(0)
    matrix = torch.randn(40, rank, dtype=torch.float64) @ torch.randn(rank, 30, dtype=torch.float64)
    result = empirical_rank(matrix)
    assert result.rank == rank
    sigma = torch.linalg.svdvals(matrix)
    assert result.tolerance == pytest.approx(float(sigma[0]) * 40 * torch.finfo(torch.float64).eps)
    assert torch.allclose(result.singular_values, sigma)


def test_tolerance_follows_the_dtype_and_full_rank_is_min_side():
    torch.manual_seed(0)
    matrix = torch.randn(12, 20)
    r32, r64 = empirical_rank(matrix), empirical_rank(matrix.double())
    assert r32.rank == r64.rank == 12
    assert r32.tolerance / r64.tolerance == pytest.approx(
        torch.finfo(torch.float32).eps / torch.finfo(torch.float64).eps, rel=1e-5
    )


def test_empirical_rank_refuses_non_matrices():
    with pytest.raises(ValueError, match=r"non-empty 2-D matrix, got shape \(5,\)"):
        empirical_rank(torch.ones(5))


def test_singular_value_cdf_is_normalised_and_monotone():
    values, fraction = singular_value_cdf(torch.tensor([4.0, 2.0, 1.0, 1.0]))
    assert values.tolist() == [0.25, 0.25, 0.5, 1.0]
    assert fraction.tolist() == [0.25, 0.5, 0.75, 1.0]


def test_expected_pairwise_kl_matches_closed_form():
    p, q = torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1])
    kl_pq = float((p * (p / q).log()).sum())
    kl_qp = float((q * (q / p).log()).sum())
    value = expected_pairwise_kl(torch.stack([p, q]).log(), block=1)
    assert value == pytest.approx((kl_pq + kl_qp) / 2)
    same = torch.log_softmax(torch.randn(1, 9), -1).expand(5, 9)
    assert expected_pairwise_kl(same) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="at least 2 contexts, got 1"):
        expected_pairwise_kl(same[:1])


def test_expected_pairwise_kl_handles_zero_probabilities():
    log_probs = torch.tensor([[0.0, -math.inf], [math.log(0.5), math.log(0.5)]])
    # KL(p1 || p2) = log 2 (0 log 0 counted as 0, no NaN); KL(p2 || p1) is infinite in exact
    # arithmetic and huge but finite here.
    value = expected_pairwise_kl(log_probs)
    assert math.isfinite(value) and value > 1e300


def test_head_bound_counts_the_bias():
    assert head_bound(Softmax(8, 20, embedding_dim=5)) == 7
    assert head_bound(Softmax(8, 20, bias=False)) == 9
    assert head_bound(MixtureOfSoftmaxes(8, 20)) is None


def test_cli_on_saved_log_prob_matrices(tmp_path, capsys):
    torch.manual_seed(0)
    low = torch.log_softmax(torch.randn(60, 3, dtype=torch.float64) @ torch.randn(3, 25, dtype=torch.float64), -1)
    high = torch.log_softmax(4 * torch.randn(60, 25, dtype=torch.float64), -1)
    torch.save(low, tmp_path / "low.pt")
    torch.save(high, tmp_path / "high.pt")
    code = main(["--log_probs", str(tmp_path / "low.pt"), str(tmp_path / "high.pt"), "--output_dir", str(tmp_path / "out")])
    assert code == 0
    out = capsys.readouterr().out
    assert "| low.pt | 60 x 25 | 4 |" in out  # rank 3 + the row normaliser
    assert "| high.pt | 60 x 25 | 25 |" in out
    assert (tmp_path / "out" / "singular_value_cdf.png").stat().st_size > 0
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "out").iterdir())


class Payload:
    """Unpickling this without weights_only runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_cli_refuses_missing_sources_and_bad_files(tmp_path):
    """No source is argparse's usage error; every unreadable --log_probs file (a vector, an empty
    file, a device, a pickle payload, a NaN matrix) is one line naming the file."""
    with pytest.raises(SystemExit):
        main([])
    torch.save(torch.ones(3), tmp_path / "vector.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save(Payload(tmp_path / "ran"), tmp_path / "payload.pt")
    torch.save(torch.tensor([[0.0, float("nan")]]), tmp_path / "nan.pt")
    for name, message in (("vector.pt", "must hold one 2-D floating-point tensor"), ("empty.pt", "cannot be read as a torch.save file"),
                          ("payload.pt", "was refused: it asks to import posix.system"), ("nan.pt", "holds NaN or +Inf values"),
                          ("/dev/zero", "is not a regular file")):
        path = name if name.startswith("/") else str(tmp_path / name)
        with pytest.raises(ValueError, match=re.escape(f"--log_probs {path} {message}")) as error:
            main(["--log_probs", path, "--output_dir", str(tmp_path / "out")])
        assert "\n" not in str(error.value)
    assert not (tmp_path / "ran").exists()


def test_cli_on_a_language_model_checkpoint(tmp_path, capsys):
    """A real checkpoint written by LanguageModel + SyntheticLM is rebuilt from the file alone."""
    from functools import partial

    from datamodules.lm_synthetic import SyntheticLM
    from tasks.encoders import AWDLSTMEncoder
    from tasks.language_model import LanguageModel

    data = SyntheticLM(
        vocab_size=40, num_topics=4, generator_dim=4, train_tokens=600, valid_tokens=200, test_tokens=200,
        batch_size=4, eval_batch_size=4, bptt=8,
    )
    model = LanguageModel(
        data.num_classes, encoder=partial(AWDLSTMEncoder, embedding_dim=8, hidden_size=12, num_layers=2), head="softmax",
        tie_weights=True,
    )
    trainer = pl.Trainer(
        max_epochs=1, limit_train_batches=2, limit_val_batches=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=data)
    path = tmp_path / "softmax.ckpt"
    trainer.save_checkpoint(path)
    code = main(["--ckpt_path", str(path), "--max_contexts", "50", "--output_dir", str(tmp_path / "out")])
    assert code == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| softmax.ckpt"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    rank, bound = int(cells[2]), int(cells[4])
    assert bound == model.head.output_embedding_dim + 2  # d + 1, plus the class bias
    assert 1 < rank <= bound
