"""analyze floor: the best width-d softmax on the synthetic language, and its bad inputs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from app.analyze.floor import fit_softmax, main

TINY = """
data:
  class_path: datamodules.SyntheticLM
  init_args: {vocab_size: 40, num_topics: 4, generator_dim: 6, topic_persistence: 0.0, temperature: 0.3,
              train_tokens: 500, valid_tokens: 300, test_tokens: 1500}
"""


def test_floor_falls_with_width_and_a_full_rank_fit_reaches_the_truth(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = tmp_path / "floor.json"
    assert main(["--config", str(config), "--widths", "1", "3", "45", "--contexts", "150",
                 "--iterations", "600", "--restarts", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    floors = [row["floor"] for row in rows]
    assert floors[0] > floors[1] > floors[2] >= 1.0 - 1e-9
    assert floors[2] < 1.01  # width >= rank: a softmax can match the true distribution
    assert floors[0] > 1.05  # width 1 cannot: the language is high-rank
    assert "| 3 |" in capsys.readouterr().out


def test_fit_of_an_exactly_low_rank_target_is_exact():
    torch.manual_seed(0)
    logits = torch.randn(30, 2, dtype=torch.float64) @ torch.randn(2, 12, dtype=torch.float64)
    log_p = torch.log_softmax(logits, 1)
    entropy = float(-(log_p.exp() * log_p).sum(1).mean())
    _, best = fit_softmax(log_p, width=2, iterations=1500, restarts=1)
    assert math.exp(best - entropy) < 1.002


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "missing.yaml"], "does not exist"),
        (["--config", "configs/lm/ptb.yaml"], "needs a config whose data is datamodules.SyntheticLM"),
        (["--widths", "0"], "--widths value >= 1"),
        (["--iterations", "0"], "--iterations >= 1"),
    ],
)
def test_bad_arguments_are_one_line(argv, message):
    with pytest.raises(ValueError, match=message):
        main(argv)
