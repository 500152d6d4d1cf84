"""Hybrid-LightRNN (seed 002): the encoding is a bijection, the factorised head gives an exact
normalised word distribution (Eq. 4), reallocation never increases its cost (Eq. 6), the
approximate matcher agrees with the exact one on tiny instances, and the learned table
survives a checkpoint round trip through the CLI."""

from __future__ import annotations

import json
import itertools
import math

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from app.checkpoint_io import read_checkpoint
from heads import HybridLightRNN, MixtureOfSoftmaxes, Softmax, create_head
from heads.lightrnn.allocation import (
    ReallocationCosts,
    approximate_reallocation,
    assignment_cost,
    block_descent,
    exact_reallocation,
    greedy_by_regret,
)
from tasks.callbacks import LightRNNReallocation
from heads.lightrnn.codes import EMPTY, HybridLightRNNCodebook, default_table_shape

HYBRID = "configs/heads/hybrid_lightrnn.yaml"
HYBRID_MOS = "configs/heads/hybrid_lightrnn_mos.yaml"


def shuffled_slots(num_words: int, num_exclusive: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """A random valid assignment: exclusive words fixed, table words in random distinct cells."""
    generator = torch.Generator().manual_seed(seed)
    cells = torch.randperm(rows * cols, generator=generator)[: num_words - num_exclusive]
    return torch.cat([torch.arange(num_exclusive), cells + num_exclusive])


# ---------------------------------------------------------------------- encoding
@pytest.mark.parametrize("num_words, num_exclusive, rows, cols", [(50, 0, None, None), (50, 7, None, None),
                                                                   (23, 3, 4, 6), (10, 10, 1, 2), (30, 0, 6, 6)])
def test_encoding_is_a_bijection(num_words, num_exclusive, rows, cols):
    for seed in (None, 0, 1):
        book = HybridLightRNNCodebook(num_words, num_exclusive, rows, cols)
        if seed is not None:
            book = HybridLightRNNCodebook(num_words, num_exclusive, book.rows, book.cols,
                                          shuffled_slots(num_words, num_exclusive, book.rows, book.cols, seed))
        words = torch.arange(num_words)
        codes = book.encode(words)
        assert len(set(codes)) == num_words, "two words share a code sequence"
        assert all(len(c) == 1 for c in codes[:num_exclusive]) and all(len(c) == 2 for c in codes[num_exclusive:])
        assert all(c[0] < book.num_first_codes and (len(c) == 1 or c[1] < book.cols) for c in codes)
        assert torch.equal(book.decode(codes), words)
        inverse = book.slot_to_word()
        assert (inverse != EMPTY).sum() == num_words and torch.equal(inverse[book.word_to_slot], words)


def test_lightrnn_is_the_square_special_case_and_default_shape_is_smallest():
    book = HybridLightRNNCodebook(50, 0, 8, 8)  # LightRNN: K = 0, d1 = d2 = ceil(sqrt 50)
    assert book.num_first_codes == 8 and all(len(c) == 2 for c in book.encode(torch.arange(50)))
    rows, cols = default_table_shape(50, 0)
    assert (rows, cols) == (7, 8) and rows * cols >= 50 and (rows - 1) * cols < 50  # no empty row
    rows, cols = default_table_shape(1000, 100)
    assert rows * cols >= 900 and cols == math.ceil(math.sqrt(900))


def test_exclusive_fraction_scales_with_the_vocabulary():
    assert HybridLightRNN(16, 50, exclusive_fraction=0.1).num_exclusive == 5
    assert HybridLightRNN(16, 10_000, exclusive_fraction=0.1).num_exclusive == 1000
    assert HybridLightRNN(16, 50, exclusive_fraction=0.0).num_exclusive == 0  # LightRNN
    assert HybridLightRNN(16, 50, num_exclusive=5, exclusive_fraction=0.1).num_exclusive == 5  # agreeing


def test_frequency_initialisation_fills_exclusive_codes_then_rows_in_order():
    book = HybridLightRNNCodebook(12, 3, 3, 3)
    assert book.encode(torch.tensor([0, 2, 3, 5, 6, 11])) == [(0,), (2,), (3, 0), (3, 2), (4, 0), (5, 2)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_exclusive=60), r"num_exclusive to be an integer in \[0, 50\].*got 60"),
        (dict(num_exclusive=-1), r"num_exclusive.*got -1"),
        (dict(rows=3, cols=4), r"num_exclusive \+ rows \* cols >= vocabulary size 50, got 0 \+ 3 \* 4 = 12"),
        (dict(rows=8), r"rows and cols both set or both unset"),
        (dict(num_exclusive=49), r"at least 2 codes per position"),
        (dict(rows=0, cols=8), r"rows to be an integer >= 1, got 0"),
        (dict(exclusive_fraction=1.0), r"exclusive_fraction in \[0, 1\).*got 1.0"),
        (dict(exclusive_fraction=0.1, num_exclusive=7), r"num_exclusive=7 and exclusive_fraction=0.1, which gives 5 of 50 words"),
    ],
)
def test_bad_head_arguments_are_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        HybridLightRNN(16, 50, **kwargs)
    assert "\n" not in str(info.value)


def test_bad_assignments_are_refused():
    with pytest.raises(ValueError, match="share a slot"):
        HybridLightRNNCodebook(5, 1, 2, 2, torch.tensor([0, 1, 1, 2, 3]))
    with pytest.raises(ValueError, match="keep exclusive codes"):
        HybridLightRNNCodebook(5, 1, 2, 2, torch.tensor([1, 0, 2, 3, 4]))
    with pytest.raises(ValueError, match="one slot per word"):
        HybridLightRNNCodebook(5, 1, 2, 2, torch.arange(4))
    with pytest.raises(ValueError, match=r"does not match this head's"):
        HybridLightRNN(16, 50, num_exclusive=4).load_structure(HybridLightRNN(16, 50).structure())
    with pytest.raises(ValueError, match="already built"):
        HybridLightRNN(16, 50, inner=Softmax(16, 8))


# ---------------------------------------------------------------------- factorised distribution
def tiny_head(inner="softmax", seed: int = 0, num_words: int = 9, num_exclusive: int = 2, rows: int = 3,
              cols: int = 3, slots: torch.Tensor | None = None) -> HybridLightRNN:
    torch.manual_seed(seed)
    head = create_head("hybrid_lightrnn", 6, num_words, num_exclusive=num_exclusive, rows=rows, cols=cols,
                       inner=inner).double()
    torch.nn.init.normal_(head.row_embedding.weight)  # make the column distribution depend on the row
    if slots is not None:
        head.set_assignment(slots)
    return head.eval()


def reference_log_prob(head: HybridLightRNN, g: torch.Tensor) -> torch.Tensor:
    """Eq. 4 word by word: P_1(code) for exclusive words, P_1(row) P_2(col | g + e_row) for
    table words, each code distribution restricted to codes that spell some word."""
    K, d2 = head.num_exclusive, head.cols
    cells = {int(s) - K for s in head.word_to_slot[K:]}
    used_rows = {c // d2 for c in cells}
    first = head.first_head.log_prob(g)  # (N, K + d1)
    allowed_first = [k for k in range(K)] + [K + r for r in sorted(used_rows)]
    first_norm = torch.logsumexp(first[:, allowed_first], dim=1)
    out = torch.empty(g.shape[0], head.num_classes, dtype=g.dtype)
    for word in range(head.num_classes):
        slot = int(head.word_to_slot[word])
        if slot < K:
            out[:, word] = first[:, slot] - first_norm
            continue
        r, c = divmod(slot - K, d2)
        column = head.column_head.log_prob(g + head.row_embedding.weight[r])  # (N, d2)
        allowed = [cc for cc in range(d2) if r * d2 + cc in cells]
        out[:, word] = first[:, K + r] - first_norm + column[:, c] - torch.logsumexp(column[:, allowed], dim=1)
    return out


@pytest.mark.parametrize("inner", ["softmax", "mos", "mixtape"])
@pytest.mark.parametrize("layout", ["full table", "empty cell", "empty row"])
def test_code_log_probs_give_an_exact_normalised_word_distribution(inner, layout):
    if layout == "full table":  # K + d1 d2 = |V|
        head = tiny_head(inner, num_words=11, num_exclusive=2, rows=3, cols=3,
                         slots=shuffled_slots(11, 2, 3, 3, seed=4))
    elif layout == "empty cell":
        head = tiny_head(inner, num_words=9, slots=shuffled_slots(9, 2, 3, 3, seed=1))
    else:  # 5 table words in rows 0 and 2 only: row 1 spells no word
        head = tiny_head(inner, num_words=7, slots=torch.tensor([0, 1, 2, 4, 8, 9, 10]))
        assert not bool(head.row_occupied[2 + 1])
    g = torch.randn(5, 6, dtype=torch.double)
    with torch.no_grad():
        log_probs = head.log_prob(g)
        total = log_probs.exp().sum(-1)
        assert (total - 1).abs().max() < 1e-12, f"max |sum p - 1| = {(total - 1).abs().max()}"
        expected = reference_log_prob(head, g)
        diff = (log_probs - expected).abs().max()
        assert diff < 1e-12, f"log_prob differs from the word-by-word Eq. 4 by {diff}"
        targets = torch.arange(head.num_classes).repeat(5, 1)[:, : head.num_classes]  # every word, every context
        nll = head(g[:, None, :].expand(5, head.num_classes, 6), targets)
        torch.testing.assert_close(nll, -log_probs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("inner", ["softmax", "mos"])
@pytest.mark.parametrize("num_exclusive, layout", [(0, "full"), (3, "full"), (3, "empty cells"), (40, "empty cells")])
def test_topk_equals_dense_topk_of_the_word_distribution(inner, num_exclusive, layout):
    num_words = num_exclusive + (8 * 8 if layout == "full" else 50)  # 50 of 64 cells: empty cells and rows
    head = tiny_head(inner, num_words=num_words, num_exclusive=num_exclusive, rows=8, cols=8,
                     slots=shuffled_slots(num_words, num_exclusive, 8, 8, seed=num_exclusive))
    torch.nn.init.normal_(head.first_head.decoder.weight, std=2.0)  # a peaked, input-dependent row distribution
    g = torch.randn(4, 7, 6, dtype=torch.double)
    with torch.no_grad():
        dense_values, dense_words = head.log_prob(g).topk(10, dim=-1)
        for k in (1, 3, 10, head.num_classes):
            values, words = head.topk(g, k)
            assert values.shape == words.shape == (4, 7, k)
            torch.testing.assert_close(values, head.log_prob(g).topk(k, dim=-1)[0], rtol=0, atol=1e-12)
            expected = head.log_prob(g).gather(-1, words)  # the returned words carry the returned scores
            torch.testing.assert_close(values, expected, rtol=0, atol=1e-12)
        assert torch.equal(head.topk(g, 10)[1], dense_words)
    with pytest.raises(ValueError, match="1 <= k <= num_classes"):
        head.topk(g, 0)


def test_topk_visits_only_the_rows_it_needs():
    """A peaked row distribution settles top-1 from one row: P_2 runs on one context per row visited."""
    head = tiny_head(num_words=3 + 64, num_exclusive=3, rows=8, cols=8)
    with torch.no_grad():
        head.first_head.decoder.bias.copy_(torch.tensor([-9.0] * 3 + [8.0] + [-9.0] * 7))  # row 0 holds ~all mass
    seen = []
    head.column_head.decoder.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    g = torch.randn(5, 6, dtype=torch.double) * 0.01
    with torch.no_grad():
        head.topk(g, 1)
    assert seen == [5], f"expected one P_2 evaluation of 5 contexts (one row each), got {seen}"


def test_mos_inner_head_runs_over_code_dictionaries_not_the_vocabulary():
    head = create_head("hybrid_lightrnn", 16, 1000, num_exclusive=24,
                       inner=lambda i, n: MixtureOfSoftmaxes(i, n, num_components=3))
    assert isinstance(head.first_head, MixtureOfSoftmaxes) and head.first_head.num_components == 3
    assert head.first_head.num_classes == 24 + head.rows and head.column_head.num_classes == head.cols == 32
    words = sum(p.numel() for p in head.parameters())
    assert words < 16 * 1000, f"{words} parameters: the head must be smaller than one word-level decoder"


# ---------------------------------------------------------------------- reallocation
def random_costs(n: int, d1: int, d2: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, d1)) * 5, rng.random((n, d2)) * 5, rng.permutation(d1 * d2)[:n]


@pytest.mark.parametrize("seed", range(6))
def test_reallocation_never_increases_the_cost_it_optimises(seed):
    row_cost, col_cost, current = random_costs(40, 5, 9, seed)
    before = assignment_cost(row_cost, col_cost, current)
    exact = exact_reallocation(row_cost, col_cost, current)
    approx = approximate_reallocation(row_cost, col_cost, current)
    for cells in (exact, approx):
        assert len(set(cells.tolist())) == 40 and cells.min() >= 0 and cells.max() < 45
        assert assignment_cost(row_cost, col_cost, cells) <= before + 1e-9
    assert assignment_cost(row_cost, col_cost, exact) <= assignment_cost(row_cost, col_cost, approx) + 1e-9
    costs = [assignment_cost(row_cost, col_cost, block_descent(row_cost, col_cost, current, s)) for s in range(1, 5)]
    assert all(b <= a + 1e-9 for a, b in zip([before, *costs], costs)), f"descent went up: {before} -> {costs}"
    # the optimum itself is a fixed point: neither solver may move away from it
    assert np.array_equal(exact_reallocation(row_cost, col_cost, exact), exact)
    assert assignment_cost(row_cost, col_cost, approximate_reallocation(row_cost, col_cost, exact)) == pytest.approx(
        assignment_cost(row_cost, col_cost, exact))


def test_exact_matcher_is_optimal_by_brute_force():
    row_cost, col_cost, current = random_costs(4, 2, 3, seed=3)
    best = min(assignment_cost(row_cost, col_cost, np.array(p)) for p in itertools.permutations(range(6), 4))
    assert assignment_cost(row_cost, col_cost, exact_reallocation(row_cost, col_cost, current)) == pytest.approx(best)


def test_exact_and_approximate_matchers_agree_on_tiny_instances():
    # planted: every word has one best row and one best column, all distinct cells
    rng = np.random.default_rng(0)
    planted = rng.permutation(12)[:10]
    row_cost = np.full((10, 3), 4.0) + rng.random((10, 3))
    col_cost = np.full((10, 4), 4.0) + rng.random((10, 4))
    row_cost[np.arange(10), planted // 4] = 0.0
    col_cost[np.arange(10), planted % 4] = 0.0
    start = rng.permutation(12)[:10]
    assert np.array_equal(exact_reallocation(row_cost, col_cost, start), planted)
    assert np.array_equal(approximate_reallocation(row_cost, col_cost, start), planted)
    assert np.array_equal(block_descent(row_cost, col_cost, greedy_by_regret(row_cost, col_cost)), planted)
    # random 8 words in a 3 x 3 table: usually the same optimum, never far from it
    ratios = []
    for seed in range(30):
        row_cost, col_cost, current = random_costs(8, 3, 3, seed)
        exact = assignment_cost(row_cost, col_cost, exact_reallocation(row_cost, col_cost, current))
        ratios.append(assignment_cost(row_cost, col_cost, approximate_reallocation(row_cost, col_cost, current)) / exact)
    ratios = np.array(ratios)
    assert (np.abs(ratios - 1) < 1e-9).mean() >= 0.5 and ratios.max() < 1.2, f"approximate/exact cost ratios {ratios}"


def test_head_accumulates_eq6_costs_from_its_own_code_likelihoods():
    # full 3 x 3 table (K + d1 d2 = |V|): raw and renormalised code distributions coincide, so the
    # accumulated cost of the current table is exactly the table words' summed NLL
    head = tiny_head(num_words=11, slots=shuffled_slots(11, 2, 3, 3, seed=2)).train()
    head.cost_accumulator = ReallocationCosts(9, 3, 3, torch.device("cpu"))
    g = torch.randn(40, 6, dtype=torch.double)
    target = torch.randint(0, 11, (40,))
    target[:3] = -100
    nll = head(g, target)
    costs = head.cost_accumulator
    in_table = target >= 2
    assert costs.tokens.sum() == int(in_table.sum())
    assert torch.equal(costs.tokens, torch.bincount(target[in_table] - 2, minlength=9).double())
    current = (head.word_to_slot[2:] - 2).numpy()
    got = assignment_cost(costs.row_cost.numpy(), costs.col_cost.numpy(), current)
    assert got == pytest.approx(float(nll[in_table].sum()), rel=1e-12)
    head.eval()  # Lightning validates inside the training epoch: evaluation must not add costs
    head(g, target)
    assert costs.tokens.sum() == int(in_table.sum())


def test_callback_refuses_bad_arguments_and_other_heads():
    with pytest.raises(ValueError, match=r"every_n_epochs to be an integer >= 1, got 0"):
        LightRNNReallocation(every_n_epochs=0)
    with pytest.raises(ValueError, match=r"solver must be auto, exact or approximate, got 'fast'"):
        LightRNNReallocation(solver="fast")

    class Model(torch.nn.Module):
        head = Softmax(4, 5)

    with pytest.raises(ValueError, match=r"needs a model whose head learns a word table \(e.g. HybridLightRNN\), got Softmax"):
        LightRNNReallocation().head_of(Model())


# ---------------------------------------------------------------------- CLI: configs, logging, checkpoints
class ProbeAtSave(Callback):
    """Records the head's log-probabilities on a fixed probe every time a checkpoint is saved."""

    def __init__(self) -> None:
        self.probe = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        head = pl_module.head
        was_training = head.training
        head.eval()
        with torch.no_grad():
            self.saved.append((head.log_prob(self.probe.to(pl_module.device)).cpu(), head.word_to_slot.cpu().clone()))
        head.train(was_training)


def test_table_survives_a_checkpoint_round_trip_through_the_cli(tmp_path):
    from app.main import main
    from tests.test_cli import ROOT, TINY_LM, TINY_SYNTHETIC, run_dirs

    args = ["--config", str(ROOT / "configs/lm/synthetic.yaml"), "--config", str(ROOT / HYBRID_MOS), *TINY_LM,
            *TINY_SYNTHETIC, *run_dirs(tmp_path), "--model.init_args.encoder.init_args.last_hidden_size", "16",
            "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "4"]
    cli = main(args, run=False)
    probe = ProbeAtSave()
    cli.trainer.callbacks.append(probe)
    reallocation = next(c for c in cli.trainer.callbacks if isinstance(c, LightRNNReallocation))
    assert isinstance(cli.model.head, HybridLightRNN) and isinstance(cli.model.head.first_head, MixtureOfSoftmaxes)
    cli.trainer.fit(cli.model, cli.datamodule)

    assert [r["epoch"] for r in reallocation.history] == [0.0, 1.0], "no reallocation after the final epoch"
    for record in reallocation.history:
        assert record["cost_after"] <= record["cost_before"] + 1e-9
    assert reallocation.history[0]["table_change"] > 0, "the first reallocation must move some words"
    assert "lightrnn/table_change" in cli.trainer.callback_metrics and "lightrnn/cost_after" in cli.trainer.callback_metrics

    last = cli.trainer.checkpoint_callback.last_model_path
    checkpoint = read_checkpoint(last)
    saved_log_probs, saved_slots = probe.saved[-1]
    assert torch.equal(saved_slots, cli.model.head.word_to_slot), "the final model keeps its checkpoint's table"
    frequency_init = torch.arange(saved_slots.numel())
    assert not torch.equal(saved_slots, frequency_init), "checkpoint was written before any reallocation"
    assert checkpoint["head_structure"]["word_to_slot"] == saved_slots.tolist()

    fresh = main(args, run=False).model  # built from the original config: frequency-initialised table
    assert torch.equal(fresh.head.word_to_slot, frequency_init)
    fresh.on_load_checkpoint(checkpoint)
    fresh.load_state_dict(checkpoint["state_dict"])
    fresh.head.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh.head.log_prob(probe.probe), saved_log_probs, rtol=0, atol=1e-6)

    # (test --ckpt_path of these configs is run by tests/test_cli.py; Lightning restores through the
    # same on_load_checkpoint + load_state_dict pair used here)


def test_plain_config_puts_a_softmax_over_each_code_dictionary(tmp_path):
    from app.main import main
    from tests.test_cli import ROOT, TINY_LM, TINY_SYNTHETIC, run_dirs

    cli = main(["--config", str(ROOT / "configs/lm/synthetic.yaml"), "--config", str(ROOT / HYBRID), *TINY_LM,
                *TINY_SYNTHETIC, *run_dirs(tmp_path)], run=False)
    head = cli.model.head
    assert isinstance(head, HybridLightRNN) and isinstance(head.first_head, Softmax) and head.num_exclusive == round(0.3 * head.num_classes)
    assert any(isinstance(c, LightRNNReallocation) for c in cli.trainer.callbacks)
    assert not cli.model.hparams.tie_weights


# ---------------------------------------------------------------------- bench
def test_bench_lightrnn_tiny_prints_the_table_and_measures_memory(capsys, tmp_path):
    from app.bench.lightrnn import Sizes, main, probe_memory

    assert main(["--tiny", "--no-memory", "--threads", "1", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    for name in ("| mos | 300 | 32 |", "| lightrnn-mos | 0+17x18 | 32 |", "| hybrid-mos | 20+17x17 | 32 |",
                 "| codes-mos | 20+17x17 | 64 |",  # the code-sequence model: two code steps per word
                 "| bpe-mos | 120 | 36 |"):  # BPE: a 120-piece vocabulary, 1.14 pieces per word
        assert name in out, out
    assert '"rows"' in (tmp_path / "r.json").read_text()

    # equal budget (seed 002 Tables 4-5): K swept for the cheaper encodings, fits read off the baseline
    assert main(["--tiny", "--no-memory", "--threads", "1", "--repeats", "1", "--heads", "mos", "--budget", "1,6",
                 "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "| hybrid-mos:6 |" in out and "| bpe-mos:1 |" in out and "equal budget" in out
    budget = json.loads((tmp_path / "b.json").read_text())["budget"]
    assert set(budget) == {"hybrid-mos", "bpe-mos"} and budget["bpe-mos"]["tried"] == [1, 6]
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    for family, fit in budget.items():  # the reported K really is the largest within the baseline's time
        within = [k for k in (1, 6) if rows[f"{family}:{k}"]["seconds"] <= rows["mos"]["seconds"]]
        assert fit["time"] == max(within, default=None)
    assert main(["--tiny", "--no-memory", "--heads", "mos:0"]) == 2
    assert "K after ':' must be an integer >= 1" in capsys.readouterr().err
    memory = probe_memory("hybrid-mos", Sizes(tokens=64, hidden=16, vocab=300, components=3, exclusive=20))
    assert memory["step"] >= 0 and memory["process"] >= 0
    assert main(["--tiny", "--no-memory", "--heads", "nope"]) == 2
    assert main(["--no-memory", "--vocab", "300", "--exclusive", "400"]) == 2
    assert "num_exclusive to be an integer in [0, 300]" in capsys.readouterr().err


def test_table_rows_lists_the_words_sharing_each_row():
    book = HybridLightRNNCodebook(8, 2, 2, 3, torch.tensor([0, 1, 7, 2, 6, 3, 4, 5]))
    itos = ["<eos>", "the", "a", "cat", "dog", "sat", "ran", "on"]
    # cells: a->5 (row 1 col 2), cat->0, dog->4 (row 1 col 1), sat->1, ran->2, on->3 (row 1 col 0)
    # row 1 holds ids 7, 4, 2 (mean 4.3), row 0 ids 3, 5, 6 (mean 4.7): row 1 is listed first
    assert book.table_rows(itos) == [(1, ["on", "dog", "a"]), (0, ["cat", "sat", "ran"])]
    with pytest.raises(ValueError, match="one string per word"):
        book.table_rows(itos[:3])


