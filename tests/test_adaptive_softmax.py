"""The adaptive softmax head (heads/adaptive_softmax.py): it answers what a direct
``nn.AdaptiveLogSoftmaxWithLoss`` answers and what the two-level factorisation gives by hand, a
training step touches only the tails its targets are in, ``topk`` skips tails and stays exact, the
derived cutoffs follow the documented rule, bad arguments are one-line errors, and
configs/heads/adaptive_softmax.yaml trains in all four tasks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from app.main import main
from heads import AdaptiveSoftmax
from heads.adaptive_softmax import derived_cutoffs, tail_width
from tests.conftest import ROOT, TinyConfig

IN, V = 16, 50
CONFIG = "configs/heads/adaptive_softmax.yaml"


def twin(head: AdaptiveSoftmax) -> nn.AdaptiveLogSoftmaxWithLoss:
    """A plain ``nn.AdaptiveLogSoftmaxWithLoss`` with the head's sizes and weights."""
    module = nn.AdaptiveLogSoftmaxWithLoss(IN, V, head.cutoffs[:-1], div_value=head.adaptive.div_value,
                                           head_bias=head.adaptive.head_bias).double()
    module.load_state_dict(head.adaptive.state_dict())
    return module


@pytest.mark.parametrize("kwargs", [{}, {"cutoffs": [4, 20, 35], "div_value": 2.0, "head_bias": True}])
def test_answers_as_a_direct_adaptive_log_softmax_with_loss(kwargs):
    """log_prob, the target log-probabilities and the loss with ignored positions equal PyTorch's module used directly."""
    head = AdaptiveSoftmax(IN, V, **kwargs).double().eval()
    module = twin(head)
    hidden = torch.randn(3, 7, IN, dtype=torch.float64)
    target = torch.randint(0, V, (3, 7))
    target[1, 2] = target[2, 6] = head.ignore_index
    torch.testing.assert_close(head.log_prob(hidden), module.log_prob(hidden.view(-1, IN)).view(3, 7, V))
    valid = target != head.ignore_index
    expected = -module(hidden[valid], target[valid]).output
    nll = head(hidden, target)
    torch.testing.assert_close(nll[valid], expected)
    assert (nll[~valid] == 0).all()


def test_two_level_factorisation_by_hand():
    """V=4, cutoffs [2]: classes 0, 1 in the shortlist, 2, 3 in one tail of width 16 // 4 = 4.
    p(0), p(1) and p(tail) are the head softmax; p(2), p(3) = p(tail) * the tail's softmax."""
    head = AdaptiveSoftmax(IN, 4, cutoffs=[2]).double().eval()
    down, up = head.adaptive.tail[0]
    with torch.no_grad():
        head.adaptive.head.weight.zero_()[:, 0] = torch.tensor([1.0, 0.0, 2.0])  # head scores g_0 * (1, 0, 2)
        down.weight.zero_()[0, 0] = 1.0  # the tail's latent is (g_0, 0, 0, 0)
        up.weight.zero_()[:, 0] = torch.tensor([0.0, 3.0])  # tail scores g_0 * (0, 3)
    hidden = torch.zeros(1, IN, dtype=torch.float64)
    hidden[0, 0] = 1.0
    e = math.exp
    p_head = [e(1) / (e(1) + 1 + e(2)), 1 / (e(1) + 1 + e(2))]
    p_tail = e(2) / (e(1) + 1 + e(2))
    p_within = [1 / (1 + e(3)), e(3) / (1 + e(3))]
    expected = torch.tensor([[*p_head, p_tail * p_within[0], p_tail * p_within[1]]], dtype=torch.float64).log()
    torch.testing.assert_close(head.log_prob(hidden), expected)
    torch.testing.assert_close(head(hidden.expand(4, IN), torch.arange(4)), -expected[0])


def test_a_training_step_computes_only_the_tails_its_targets_are_in():
    """The defining saving: targets all in the shortlist leave every tail without a gradient;
    a target in the second tail reaches that tail only."""
    head = AdaptiveSoftmax(IN, V, cutoffs=[10, 30])
    hidden = torch.randn(6, IN)
    head(hidden, torch.randint(0, 10, (6,))).sum().backward()
    assert all(p.grad is None for p in head.adaptive.tail.parameters())
    head.zero_grad(set_to_none=True)
    head(hidden[:1], torch.tensor([40])).sum().backward()
    assert all(p.grad is None for p in head.adaptive.tail[0].parameters())
    assert all(p.grad.abs().sum() > 0 for p in head.adaptive.tail[1].parameters())


@pytest.mark.parametrize("k", [1, 3, 12])
def test_topk_skips_tails_and_equals_the_full_log_prob_topk(k):
    """Exact: values and indices equal ``log_prob(...).topk`` (k=12 exceeds the 10-class shortlist,
    so every tail is needed), while for small k tails are skipped for some rows."""
    torch.manual_seed(3)
    head = AdaptiveSoftmax(IN, V, cutoffs=[10, 30]).double().eval()
    with torch.no_grad():
        head.adaptive.head.weight.mul_(4.0)  # a peaked head: the tails rarely matter
    hidden = torch.randn(64, IN, dtype=torch.float64)
    values, indices = head.topk(hidden, k)
    expected_values, expected_indices = head.log_prob(hidden).topk(k, dim=-1)
    torch.testing.assert_close(values, expected_values)
    assert torch.equal(indices, expected_indices)
    needed = head.needed_tails(torch.log_softmax(head.adaptive.head(hidden), -1), k)
    assert needed.all() if k > 10 else not needed.all(), "the test must exercise skipped tails"


@pytest.mark.parametrize(("num_classes", "width", "div_value", "expected"), [
    (10_000, 400, 4.0, [625, 2500]),  # shortlist V/16, tails [V/16, V/4) and [V/4, V)
    (50, 16, 4.0, [3, 12]),
    (40, 8, 4.0, [10]),  # 8 // 4**2 = 0: only the [V/4, V) tail fits
    (8, 64, 4.0, [1, 2]),  # tiny vocabularies: distinct, inside [1, V - 1]
    (2, 16, 4.0, [1]),
    (1000, 8, 2.0, [62, 250]),
])
def test_derived_cutoffs_follow_the_documented_rule(num_classes, width, div_value, expected):
    assert derived_cutoffs(num_classes, width, div_value) == expected
    head = AdaptiveSoftmax(width, num_classes, div_value=div_value)
    assert head.cutoffs == [*expected, num_classes]


def test_derived_cutoffs_are_valid_for_every_small_vocabulary_and_width():
    for num_classes in range(2, 300):
        for width in (4, 8, 17, 64):
            cutoffs = derived_cutoffs(num_classes, width)
            assert cutoffs == sorted(set(cutoffs)) and 1 <= cutoffs[0] and cutoffs[-1] <= num_classes - 1, (num_classes, width)
            assert all(tail_width(width, 4.0, c) >= 1 for c in range(1, len(cutoffs) + 1)), (num_classes, width)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cutoffs": [20, 10]}, "AdaptiveSoftmax needs cutoffs to be increasing distinct integers in [1, num_classes - 1 = 49], "
                            "got [20, 10] (set head.init_args.cutoffs, e.g. [3], or null to derive them)"),
    ({"cutoffs": [10, 50]}, "AdaptiveSoftmax needs cutoffs to be increasing distinct integers in [1, num_classes - 1 = 49], "
                            "got [10, 50] (set head.init_args.cutoffs, e.g. [3], or null to derive them)"),
    ({"cutoffs": []}, "AdaptiveSoftmax needs cutoffs to be increasing distinct integers in [1, num_classes - 1 = 49], "
                      "got [] (set head.init_args.cutoffs, e.g. [3], or null to derive them)"),
    ({"cutoffs": [5, 10, 20]}, "AdaptiveSoftmax tail cluster 3 of 3 would have a projection of width 16 // 4**3 = 0 "
                               "(set head.init_args.cutoffs to at most 2 values or lower head.init_args.div_value)"),
    ({"div_value": 0.5}, "AdaptiveSoftmax needs div_value to be a number >= 1 (a tail is never wider than the head), "
                         "got 0.5 (set head.init_args.div_value, e.g. 4.0)"),
    ({"div_value": 32.0}, "AdaptiveSoftmax needs a latent width >= div_value for a tail cluster of width >= 1, got width 16 "
                          "and div_value 32 (set head.init_args.div_value to at most 16 or widen head.init_args.embedding_dim)"),
    ({"dropout": 1.0}, "AdaptiveSoftmax needs dropout in [0, 1), got 1.0 (set head.init_args.dropout)"),
    ({"embedding_dim": 0}, "AdaptiveSoftmax needs embedding_dim to be an integer >= 1, got 0 (set head.init_args.embedding_dim)"),
])
def test_bad_arguments_are_one_line_errors_naming_value_rule_and_fix(kwargs, message):
    with pytest.raises(ValueError) as info:
        AdaptiveSoftmax(IN, V, **kwargs)
    assert str(info.value) == message


def test_tying_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^AdaptiveSoftmax has no num_classes x d class-embedding matrix to tie .*"
                                         r"\(set model.init_args.tie_weights: false\)$"):
        AdaptiveSoftmax(IN, V).tie_to(nn.Embedding(V, IN))


# ------------------------------------------------------------------ the config in every task
def lm_args(tmp_path) -> list[str]:
    return TinyConfig().args("configs/lm/synthetic.yaml", CONFIG, directory=tmp_path)


def translation_args(tmp_path) -> list[str]:
    from tests.test_translation import TINY, TINY_LSTM, synthetic_args

    return [*synthetic_args("configs/translation/synthetic_lstm.yaml", tmp_path), "--config", str(ROOT / CONFIG), *TINY_LSTM, *TINY]


def captioning_args(tmp_path) -> list[str]:
    from tests.test_captioning import shrink

    return ["--config", "configs/captioning/synthetic.yaml", "--config", CONFIG, *shrink(tmp_path), "--trainer.max_epochs", "1",
            "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]


def hanzi_args(tmp_path) -> list[str]:
    from tests.test_hanzi import TINY_FONTS, run_dirs

    return ["--config", str(ROOT / "configs/hanzi/font_rendered.yaml"), "--config", str(ROOT / CONFIG), *TINY_FONTS,
            *run_dirs(tmp_path), "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]


@pytest.mark.parametrize("task_args", [lm_args, translation_args, captioning_args, hanzi_args],
                         ids=["lm", "translation", "captioning", "hanzi"])
def test_the_head_config_trains_in_every_task(task_args, tmp_path):
    """configs/heads/adaptive_softmax.yaml composed onto each task's tiny synthetic config: the
    task builds the head with derived cutoffs for its data's classes and validates a finite loss."""
    cli = main(["fit", *task_args(tmp_path)])
    head = cli.model.head
    assert isinstance(head, AdaptiveSoftmax) and head.cutoffs[-1] == cli.datamodule.num_classes
    assert head.cutoffs[:-1] == derived_cutoffs(head.num_classes, head.adaptive.in_features)
    assert math.isfinite(float(cli.trainer.callback_metrics["val/loss"]))
