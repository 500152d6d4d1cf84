"""Greedy and beam search (tasks/decoding.py) on hand-built and random tiny step functions:
beam 1 equals greedy, a wide beam finds the exhaustive optimum, a beam of two finds the
best sequence greedy misses, batching does not change results, budgets and settings hold."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tasks.decoding import (
    Candidates,
    Hypothesis,
    beam_search,
    check_search_settings,
    greedy_search,
    max_lengths,
    select_rows,
)

BOS, EOS = 0, 1


def markov_step(table: torch.Tensor):
    """Step function of a model whose next-token log-probabilities depend on the sentence
    (carried in the state) and the last token: ``table (B, V, V)`` of log-probabilities."""

    def step(tokens, state):
        sentence = state["sentence"]  # (N,)
        return table[sentence, tokens[:, -1]], state  # (N, V)

    return step


def random_table(batch: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, vocab, generator=generator) * 2.0
    logits[:, :, BOS] = -math.inf  # BOS is never generated
    return torch.log_softmax(logits, dim=-1)


def exhaustive_best(table: torch.Tensor, sentence: int, max_len: int, alpha: float) -> tuple[list[int], float]:
    """Score every sequence that ends in EOS within ``max_len`` tokens (EOS forced at the end)."""
    V = table.size(-1)
    best, best_score = None, -math.inf
    for length in range(1, max_len + 1):
        for body in itertools.product(range(2, V), repeat=length - 1):
            previous, total = BOS, 0.0
            for token in body:
                total += float(table[sentence, previous, token])
                previous = token
            total += 0.0 if length == max_len else float(table[sentence, previous, EOS])  # forced EOS scores 0
            score = total / length**alpha
            if score > best_score:
                best, best_score = list(body), score
    return best, best_score


def state_for(batch: int) -> dict:
    return {"sentence": torch.arange(batch)}


@pytest.mark.parametrize("seed", range(4))
def test_beam_size_one_equals_greedy(seed):
    B, V = 5, 7
    table = random_table(B, V, seed)
    budget = torch.tensor([1, 3, 6, 8, 10])
    greedy = greedy_search(markov_step(table), state_for(B), B, BOS, EOS, budget)
    beam = beam_search(markov_step(table), state_for(B), B, BOS, EOS, budget, beam_size=1, length_penalty=0.0)
    for g, (b,) in zip(greedy, beam):
        assert g.tokens == b.tokens
        assert g.log_prob == pytest.approx(b.log_prob, abs=1e-5)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize("seed", range(3))
def test_wide_exact_beam_returns_the_exhaustive_optimum(seed, alpha):
    B, V, L = 3, 5, 4  # 3 non-special tokens: 1 + 3 + 9 + 27 sequences
    table = random_table(B, V, 10 + seed)
    budget = torch.full((B,), L)
    results = beam_search(markov_step(table), state_for(B), B, BOS, EOS, budget, beam_size=V**L,
                          length_penalty=alpha, nbest=1, early_stopping=False)
    for sentence, (hyp,) in enumerate(results):
        tokens, score = exhaustive_best(table, sentence, L, alpha)
        assert hyp.tokens == tokens, f"sentence {sentence}: beam {hyp.tokens} vs exhaustive {tokens}"
        assert hyp.score == pytest.approx(score, abs=1e-5)


def test_beam_of_two_finds_the_best_sequence_greedy_misses():
    # Tokens: 0 BOS, 1 EOS, 2 "a", 3 "b". First step prefers a (0.6) over b (0.4), but after
    # "a" the model is unsure (EOS 0.3) while after "b" it is certain (EOS 1.0):
    # P(a EOS) = 0.18 and P(a b EOS) = 0.21 < P(b EOS) = 0.4, so the best sequence is "b".
    probs = torch.zeros(4, 4)
    probs[BOS] = torch.tensor([0.0, 0.0, 0.6, 0.4])
    probs[2] = torch.tensor([0.0, 0.3, 0.35, 0.35])
    probs[3] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    table = probs.log().unsqueeze(0)  # (1, V, V)
    budget = torch.tensor([5])
    greedy = greedy_search(markov_step(table), state_for(1), 1, BOS, EOS, budget)
    assert greedy[0].tokens[0] == 2, "the hand-built model must fool greedy search"
    (best, second), = beam_search(markov_step(table), state_for(1), 1, BOS, EOS, budget, beam_size=2,
                                  length_penalty=0.0, nbest=2)
    assert best.tokens == [3] and best.log_prob == pytest.approx(math.log(0.4))
    assert second.tokens == [2, 3] and second.log_prob == pytest.approx(math.log(0.6 * 0.35))  # a b EOS


def test_nbest_are_distinct_and_sorted():
    B, V = 2, 6
    table = random_table(B, V, 3)
    results = beam_search(markov_step(table), state_for(B), B, BOS, EOS, torch.full((B,), 6), beam_size=4, nbest=4)
    for hyps in results:
        assert len(hyps) == 4
        assert len({tuple(h.tokens) for h in hyps}) == 4
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        for h in hyps:  # length-normalised score with the default alpha = 1 (EOS counted)
            assert h.score == pytest.approx(h.log_prob / (len(h.tokens) + 1), abs=1e-5)


def test_batching_does_not_change_results():
    B, V = 4, 6
    table = random_table(B, V, 7)
    budget = torch.tensor([2, 5, 7, 4])
    together = beam_search(markov_step(table), state_for(B), B, BOS, EOS, budget, beam_size=3, nbest=2)
    for b in range(B):
        alone = beam_search(markov_step(table[b : b + 1]), state_for(1), 1, BOS, EOS, budget[b : b + 1], beam_size=3, nbest=2)
        assert [h.tokens for h in alone[0]] == [h.tokens for h in together[b]]


def top_step(table: torch.Tensor, width: int):
    """The same model as markov_step, returning only each row's best ``width`` tokens."""
    full = markov_step(table)

    def step(tokens, state):
        log_probs, state = full(tokens, state)
        return Candidates(*log_probs.topk(width, dim=-1)), state

    return step


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("beam, nbest, early", [(1, 1, True), (2, 1, True), (3, 3, True), (3, 2, False)])
def test_searches_over_2k_candidates_equal_searches_over_the_full_distribution(seed, beam, nbest, early):
    B, V = 4, 9
    table = random_table(B, V, seed)
    budget = torch.tensor([1, 3, 5, 7])
    full = beam_search(markov_step(table), state_for(B), B, BOS, EOS, budget, beam, 1.0, nbest, early)
    top = beam_search(top_step(table, 2 * beam), state_for(B), B, BOS, EOS, budget, beam, 1.0, nbest, early)
    assert [[h.tokens for h in hyps] for hyps in top] == [[h.tokens for h in hyps] for hyps in full]
    assert [h.score for hyps in top for h in hyps] == pytest.approx([h.score for hyps in full for h in hyps], abs=1e-6)
    greedy_full = greedy_search(markov_step(table), state_for(B), B, BOS, EOS, budget)
    greedy_top = greedy_search(top_step(table, 1), state_for(B), B, BOS, EOS, budget)
    assert [h.tokens for h in greedy_top] == [h.tokens for h in greedy_full]


def test_length_budget_forces_eos():
    V = 5
    table = random_table(1, V, 0)
    table[:, :, EOS] = -50.0  # the model never wants to stop
    table = torch.log_softmax(table, dim=-1)
    for budget in (1, 3, 6):
        (greedy,) = greedy_search(markov_step(table), state_for(1), 1, BOS, EOS, torch.tensor([budget]))
        (hyps,) = beam_search(markov_step(table), state_for(1), 1, BOS, EOS, torch.tensor([budget]), beam_size=3, nbest=3)
        assert len(greedy.tokens) == budget - 1
        assert all(len(h.tokens) == budget - 1 for h in hyps)
        # the same with candidate rows that do not hold EOS at all: EOS is still forced
        (top,) = beam_search(top_step(table, 2), state_for(1), 1, BOS, EOS, torch.tensor([budget]), beam_size=1)
        assert len(top[0].tokens) == budget - 1


def test_max_lengths_follow_a_times_source_plus_b():
    lengths = torch.tensor([0, 4, 10])
    assert max_lengths(lengths, 1.5, 2).tolist() == [2, 8, 17]
    assert max_lengths(lengths, 0.0, 0).tolist() == [1, 1, 1]  # at least EOS
    assert max_lengths(lengths, 2.0, 5, limit=12).tolist() == [5, 12, 12]


def test_select_rows_reorders_nested_state():
    state = {"memory": torch.arange(6).view(3, 2), "pair": (torch.tensor([10, 11, 12]), [torch.zeros(3, 1)]), "flag": 7}
    picked = select_rows(state, torch.tensor([2, 0, 0]))
    assert picked["memory"].tolist() == [[4, 5], [0, 1], [0, 1]]
    assert picked["pair"][0].tolist() == [12, 10, 10] and picked["pair"][1][0].shape == (3, 1)
    assert picked["flag"] == 7


@pytest.mark.parametrize(
    "beam, nbest, a, b, match",
    [(0, 1, 1.0, 5, "beam_size to be an integer >= 1, got 0"),
     (2, 3, 1.0, 5, "1 <= nbest <= beam_size, got nbest=3 with beam_size=2"),
     (2, 1, -1.0, 5, "max_len_a >= 0"),
     (2, 1, 0.0, 0, "at least one token")],
)
def test_bad_search_settings_are_one_line_errors(beam, nbest, a, b, match):
    with pytest.raises(ValueError, match=match) as info:
        check_search_settings(beam, nbest, a, b)
    assert "\n" not in str(info.value) and "model.init_args" in str(info.value)


def test_hypothesis_is_plain_data():
    h = Hypothesis([3, 4], -1.5, -0.5)
    assert (h.tokens, h.log_prob, h.score) == ([3, 4], -1.5, -0.5)


@pytest.mark.parametrize("early_stopping", [True, False])
def test_confident_model_is_not_cut_short_by_finished_prefixes(early_stopping):
    # A near-deterministic model (the regime of a well-trained one) that says "a b c d EOS".
    # Ending early costs ~9 nats at every step while every other token costs ~14, so the
    # prefixes "a EOS", "a b EOS", "a b c EOS" are each in the top K when they appear: three
    # finished hypotheses before the right one ends. Stopping on that count alone returned
    # the best prefix (CI: synthetic test BLEU 87.7 with brevity penalty 0.90 where greedy
    # had 100); the search must keep going while a live hypothesis still scores better.
    V = 7  # 0 BOS, 1 EOS, 2..5 a b c d, 6 unused
    logits = torch.full((V, V), -14.0)
    logits[:, EOS] = -9.0
    for previous, following in ((BOS, 2), (2, 3), (3, 4), (4, 5), (5, EOS)):
        logits[previous, following] = 0.0
    table = torch.log_softmax(logits, dim=-1).unsqueeze(0)  # (1, V, V)
    (best,), = beam_search(markov_step(table), state_for(1), 1, BOS, EOS, torch.tensor([10]), beam_size=3,
                           length_penalty=1.0, early_stopping=early_stopping)
    assert best.tokens == [2, 3, 4, 5]
