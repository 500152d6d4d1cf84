"""Autoregressive decoding shared by every sequence-producing task (translation, captioning).

Both searches talk to the model through one *step function*::

    step(tokens, state) -> (log_probs, state)

``tokens`` is ``(N, t)``: every row's tokens so far, starting with BOS; ``log_probs`` is
``(N, V)``, the model's normalised log-probabilities of the next token (a head's
``log_prob``); ``state`` is anything the model wants to carry between steps (encoder
memory, recurrent state, a key/value cache) as a nested dict/tuple/list of tensors whose
first dimension is the row ``N``. Beam search reorders rows with :func:`select_rows`, so a
model that follows that layout needs no search-specific code.

Neither search looks past a row's ``2 * beam_size`` best tokens (beam search keeps the best
``2K`` continuations of ``K`` rows; greedy takes one), so a step may instead return only those
as :class:`Candidates` ``(log_probs (N, w), tokens (N, w))``, and nothing ``V``-wide is formed:
:func:`head_candidates` asks a head's ``topk``, its inference path (DS-Softmax answers from the
chosen expert's kept classes, Hybrid-LightRNN visits only the code rows that can still hold a
top word), with the same hypotheses as the full ``log_prob`` for heads whose ``topk`` is exact.

Scores: a finished hypothesis of length ``L`` (generated tokens including EOS) and summed
log-probability ``s`` is ranked by ``s / L ** length_penalty`` (``length_penalty = 0``
is the plain sum; ``1`` the per-token average, as in fairseq). Maximum length per sentence
is ``max_len_a * source_length + max_len_b`` (:func:`max_lengths`); at that length EOS is
forced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

#: Hard cap on generated length, whatever a task's length budget says.
DECODE_LIMIT = 512


class Candidates(NamedTuple):
    """A step's best ``w`` next tokens per row (best first): log-probabilities and token ids,
    each ``(N, w)``; what a step may return instead of the full ``(N, V)`` log-probabilities."""

    log_probs: Tensor
    tokens: Tensor


StepFunction = Callable[[Tensor, Any], "tuple[Tensor | Candidates, Any]"]


@dataclass
class Hypothesis:
    """A finished output: generated ``tokens`` (EOS removed), summed log-probability and
    the length-normalised ``score`` the search ranked it by."""

    tokens: list[int]
    log_prob: float
    score: float


def select_rows(state: Any, index: Tensor) -> Any:
    """Index dimension 0 of every tensor in a nested dict/tuple/list ``state``."""
    if state is None:
        return None
    if isinstance(state, Tensor):
        return state.index_select(0, index)
    if isinstance(state, dict):
        return {key: select_rows(value, index) for key, value in state.items()}
    if isinstance(state, (tuple, list)):
        return type(state)(select_rows(value, index) for value in state)
    return state  # constants (ints, flags) are shared by all rows


def max_lengths(source_lengths: Tensor, max_len_a: float, max_len_b: int, limit: int | None = None) -> Tensor:
    """Per-sentence length budget ``a * |source| + b`` (at least 1, at most ``limit``).

    Shape: ``(B,) -> (B,)`` long.
    """
    budget = torch.floor(source_lengths.float() * max_len_a).long() + int(max_len_b)
    budget = budget.clamp(min=1)
    if limit is not None:
        budget = budget.clamp(max=limit)
    return budget


def check_search_settings(beam_size: int, nbest: int, max_len_a: float, max_len_b: int) -> None:
    """One-line errors for impossible decoding settings."""
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam search needs beam_size to be an integer >= 1, got {beam_size!r} (set model.init_args.beam_size)")
    if not 1 <= nbest <= beam_size:
        raise ValueError(f"beam search needs 1 <= nbest <= beam_size, got nbest={nbest} with beam_size={beam_size} (set model.init_args.nbest)")
    if max_len_a < 0 or max_len_b < 0 or (max_len_a == 0 and max_len_b < 1):
        raise ValueError(
            f"decoding needs max_len_a >= 0 and max_len_b >= 0 giving at least one token, got "
            f"max_len_a={max_len_a}, max_len_b={max_len_b} (set model.init_args.max_len_a / max_len_b)"
        )


@torch.no_grad()
def greedy_search(
    step: StepFunction,
    state: Any,
    batch_size: int,
    bos: int,
    eos: int,
    max_len: Tensor,
    device: torch.device | str = "cpu",
) -> list[Hypothesis]:
    """Pick the most probable next token until EOS or the length budget.

    Args:
        step: ``(tokens (B, t), state) -> (log_probs (B, V) or Candidates, state)``.
        state: initial model state, rows = sentences.
        max_len: ``(B,)`` maximum number of generated tokens, EOS included.

    Returns one :class:`Hypothesis` per sentence, in input order.
    """
    tokens = torch.full((batch_size, 1), bos, dtype=torch.long, device=device)  # (B, 1)
    log_prob = torch.zeros(batch_size, device=device)
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
    max_len = max_len.to(device)
    for t in range(1, int(max_len.max()) + 1):
        out, state = step(tokens, state)
        values, candidates = _force_eos(_as_candidates(out), max_len <= t, eos)  # (B, w) each
        best, position = values.max(dim=-1)  # (B,)
        token = candidates.gather(1, position.unsqueeze(1)).squeeze(1)  # (B,)
        token = token.masked_fill(finished, eos)  # finished rows only pad with EOS
        log_prob = log_prob + best.masked_fill(finished, 0.0)
        lengths = lengths + (~finished).long()
        finished = finished | (token == eos)
        tokens = torch.cat([tokens, token.unsqueeze(1)], dim=1)  # (B, t + 1)
        if bool(finished.all()):
            break
    results = []
    for row in range(batch_size):
        length = int(lengths[row])
        generated = tokens[row, 1 : 1 + length].tolist()
        if generated and generated[-1] == eos:
            generated = generated[:-1]
        results.append(Hypothesis(generated, float(log_prob[row]), float(log_prob[row])))
    return results


@torch.no_grad()
def beam_search(
    step: StepFunction,
    state: Any,
    batch_size: int,
    bos: int,
    eos: int,
    max_len: Tensor,
    beam_size: int = 5,
    length_penalty: float = 1.0,
    nbest: int = 1,
    early_stopping: bool = True,
    device: torch.device | str = "cpu",
) -> list[list[Hypothesis]]:
    """Batched beam search: ``beam_size`` live hypotheses per sentence, all sentences at once.

    Each step scores ``B * K`` live rows in one ``step`` call, keeps the best ``2K``
    continuations per sentence (at most ``K`` of them can be EOS, so ``K`` live ones always
    remain), moves EOS continuations ranked within the top ``K`` to the finished list and
    continues with the ``K`` best non-EOS ones.

    Stopping (per sentence): at the length budget; with ``early_stopping`` once
    ``beam_size`` hypotheses have finished *and* the best live one, were it to end at the next
    step at no cost, would not outrank the ``nbest``-th finished one (fairseq's count alone
    returns a cheap finished prefix of a confident model's answer); without it, only once no
    live hypothesis can still beat the ``nbest``-th finished one — log-probabilities only
    fall, so the best live sum divided by the largest reachable length denominator bounds
    every continuation, which makes the search exact for ``beam_size >= V ** max_len``.

    Args:
        step: ``(tokens (B*K, t), state) -> (log_probs (B*K, V) or Candidates, state)``.
        state: initial state with ``B`` rows; expanded here to ``B * K`` rows.
        max_len: ``(B,)`` maximum generated length (EOS included).
        length_penalty: exponent ``alpha`` of the length normaliser ``L ** alpha``.
        nbest: hypotheses returned per sentence, best first.

    Returns ``B`` lists of ``nbest`` :class:`Hypothesis` (fewer only if the budget left
    fewer distinct hypotheses).
    """
    check_search_settings(beam_size, nbest, 0.0, 1)
    B, K = batch_size, beam_size
    max_len = max_len.to(device)
    # Every sentence starts with K copies of its state; only copy 0 is live (others -inf)
    # so the first step does not pick the same continuation K times.
    state = select_rows(state, torch.arange(B, device=device).repeat_interleave(K))
    tokens = torch.full((B * K, 1), bos, dtype=torch.long, device=device)  # (B*K, 1)
    beam_scores = torch.full((B, K), -math.inf, device=device)
    beam_scores[:, 0] = 0.0
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    done = [False] * B
    batch_offsets = (torch.arange(B, device=device) * K).unsqueeze(1)  # (B, 1)

    def normaliser(length: int) -> float:
        return float(length) ** length_penalty

    for t in range(1, int(max_len.max()) + 1):
        out, state = step(tokens, state)
        at_budget = (max_len <= t).repeat_interleave(K)  # (B*K,)
        values, row_tokens = _force_eos(_as_candidates(out), at_budget, eos)  # (B*K, w) each, w = V for full rows
        w = values.size(-1)
        candidates = beam_scores.unsqueeze(-1) + values.view(B, K, w)  # (B, K, w)
        num_candidates = min(2 * K, K * w)
        cand_scores, flat_index = candidates.view(B, K * w).topk(num_candidates, dim=-1)  # (B, 2K)
        cand_beam = torch.div(flat_index, w, rounding_mode="floor")  # (B, 2K)
        cand_token = row_tokens.reshape(B, K * w).gather(1, flat_index)  # (B, 2K)
        is_eos = (cand_token == eos) & torch.isfinite(cand_scores)

        # Finish EOS continuations ranked within the top K (the rest are worse than K live ones).
        position = torch.arange(num_candidates, device=device).unsqueeze(0)  # (1, 2K)
        to_finish = is_eos & (position < K)
        for b, c in to_finish.nonzero().tolist():
            if done[b]:
                continue
            row = int(batch_offsets[b, 0] + cand_beam[b, c])
            generated = tokens[row, 1:].tolist()
            total = float(cand_scores[b, c])
            finished[b].append(Hypothesis(generated, total, total / normaliser(t)))

        # Next beam: the K best non-EOS continuations (stable order keeps ranking).
        rank_key = position + is_eos.long() * num_candidates  # push EOS behind live ones
        keep = rank_key.argsort(dim=-1)[:, :K]  # (B, K)
        next_scores = cand_scores.gather(1, keep)  # (B, K)
        next_scores = next_scores.masked_fill(is_eos.gather(1, keep), -math.inf)
        next_rows = (batch_offsets + cand_beam.gather(1, keep)).view(-1)  # (B*K,)
        next_tokens = cand_token.gather(1, keep).view(-1, 1)  # (B*K, 1)

        for b in range(B):
            if done[b]:
                continue
            finished[b].sort(key=lambda h: -h.score)
            if t >= int(max_len[b]):
                done[b] = True
            elif early_stopping and len(finished[b]) >= K:
                # K finished is not enough on its own: a confident model finishes one cheap
                # prefix ("a </s>", "a b </s>", ...) per step while the right hypothesis is
                # still live. Stop once none of the live ones, ended at the next step at no
                # cost, would outrank the nbest-th finished one.
                best_live = float(next_scores[b].max())
                done[b] = not math.isfinite(best_live) or finished[b][nbest - 1].score >= best_live / normaliser(t + 1)
            elif not early_stopping and len(finished[b]) >= nbest:
                best_live = float(next_scores[b].max())
                # Largest reachable denominator over lengths t+1 .. max_len (alpha may be < 0).
                bound = best_live / max(normaliser(t + 1), normaliser(int(max_len[b])))
                done[b] = not math.isfinite(best_live) or finished[b][nbest - 1].score >= bound
        if all(done):
            break
        tokens = torch.cat([tokens.index_select(0, next_rows), next_tokens], dim=1)  # (B*K, t + 1)
        state = select_rows(state, next_rows)
        beam_scores = next_scores
    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finished]


def head_candidates(head: Any, hidden: Tensor, k: int) -> Candidates:
    """The head's ``topk(hidden, k)`` as a step's :class:`Candidates` (``k`` capped at ``V``).

    Shape: hidden ``(N, in_features)`` -> two ``(N, k)`` tensors.
    """
    values, tokens = head.topk(hidden, min(k, head.num_classes))
    return Candidates(values.float(), tokens)


def _as_candidates(out: "Tensor | Candidates") -> Candidates:
    """A step's output as candidates: full ``(N, V)`` log-probabilities become ``V`` of them."""
    if isinstance(out, Candidates):
        return out
    tokens = torch.arange(out.size(-1), device=out.device).expand(out.size(0), -1)
    return Candidates(out.float(), tokens)


def _force_eos(candidates: Candidates, rows: Tensor, eos: int) -> Candidates:
    """Rows at their length budget may only emit EOS: their first candidate becomes EOS with
    log-probability 0 and the others ``-inf``. Shape ``(N, w)`` with ``rows (N,)``."""
    if not bool(rows.any()):
        return candidates
    values, tokens = candidates
    forced_values = torch.full_like(values, -math.inf)
    forced_values[:, 0] = 0.0
    forced_tokens = tokens.clone()
    forced_tokens[:, 0] = eos
    at = rows.unsqueeze(-1)
    return Candidates(torch.where(at, forced_values, values), torch.where(at, forced_tokens, tokens))
