"""Hybrid-LightRNN output layer, output-only: any head run over a small code dictionary instead of
the word vocabulary while the network reads words (seed 002, Kong et al., "Fast and Simple Mixture
of Softmaxes with BPE and Hybrid-LightRNN", §3; LightRNN, Li et al. NeurIPS 2016). Seed 002's
Eq. 4, a language model over code sequences whose network reads codes, is
:mod:`heads.lightrnn.code_lm`; this head keeps word inputs so it serves every task.

Every word ``w`` has a code sequence of length one or two (:mod:`heads.lightrnn.codes`): an
exclusive code ``k`` (the ``K`` most frequent words) or a table cell ``(r, c)``. The next-word
probability factorises along the code sequence:

    p(w = k | g)      = P_1(k | g)                                    exclusive words
    p(w = (r, c) | g) = P_1(K + r | g) * P_2(c | g + e_r)             table words

``P_1`` is one inner head over the ``K + d1`` first-position codes, ``P_2`` a second inner
head over the ``d2`` column codes (Eq. 4 uses one code dictionary). LightRNN and Eq. 4 feed the
row code back through the network before predicting the column; a head cannot re-run the
encoder, so it conditions ``P_2`` on the row by adding a learned row embedding ``e_r`` to the
context ``g`` (zero-initialised, so training starts from a row-independent column distribution). The inner heads are any
registered head (Softmax, MoS, Mixtape...), so MoS with ``K_mos`` components costs
``O(K_mos d (K + d1 + d2))`` per token instead of ``O(K_mos d |V|)``.

Exactness. ``log p(w | g)`` is the sum of the code log-probabilities, so perplexity stays
word-level and comparable with word-level heads. When the table has empty cells
(``K + d1 d2 > |V|``), ``P_1`` is renormalised over the rows that hold a word and ``P_2`` over
the occupied cells of the row: no probability is lost on code sequences that spell no word,
and ``log_prob`` sums to one exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor, nn

from heads.base import IGNORE_INDEX, OutputHead
from heads.lightrnn.codes import EMPTY, HybridLightRNNCodebook, default_table_shape
from heads.registry import HeadSpec, build_head, register_head
from heads.validation import check_share

if TYPE_CHECKING:  # numpy is needed by the table reallocation only (heads/lightrnn/allocation.py)
    import numpy as np

    from heads.lightrnn.allocation import ReallocationCosts


@register_head("hybrid_lightrnn", family="encoding")
class HybridLightRNN(OutputHead):
    """Factorised output over Hybrid-LightRNN codes (output-only; word inputs), wrapping any inner head.

    Args:
        in_features: hidden size of the encoder output ``g``.
        num_classes: vocabulary size ``|V|`` (ids sorted by decreasing frequency).
        num_exclusive: ``K``, the most frequent words that get an exclusive length-1 code
            (0 gives LightRNN).
        exclusive_fraction: alternatively ``K`` as a fraction of ``|V|`` (``round(f |V|)``),
            so one config suits any vocabulary size; 0 (default) uses ``num_exclusive``. If
            both are set they must agree (a checkpoint's ``num_exclusive`` under a config's
            fraction).
        rows, cols: table shape ``d1 x d2`` for the other words; default the smallest
            near-square table (``d2 = ceil(sqrt(|V| - K))``).
        inner: the head run over each code dictionary, a short name or a ``class_path``
            factory (e.g. ``heads.MixtureOfSoftmaxes`` with ``num_components: 3``).
        ignore_index: target value that contributes zero loss.
    """

    requires_frequency_order = True  # the K exclusive codes go to ids 0..K-1, the most frequent

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_exclusive: int = 0,
        rows: int | None = None,
        cols: int | None = None,
        inner: HeadSpec = "softmax",
        ignore_index: int = IGNORE_INDEX,
        exclusive_fraction: float = 0.0,
    ) -> None:
        super().__init__(in_features, num_classes, ignore_index)
        codebook = self._build_table(num_classes, num_exclusive, rows, cols, exclusive_fraction)
        self.first_head = build_head(inner, in_features, codebook.num_first_codes, ignore_index, setting="head.init_args.inner")  # P_1
        self.column_head = build_head(inner, in_features, codebook.cols, ignore_index, setting="head.init_args.inner")  # P_2
        self.row_embedding = nn.Embedding(codebook.rows, in_features)  # e_r, added to g before P_2
        nn.init.zeros_(self.row_embedding.weight)

    def _build_table(
        self, num_classes: int, num_exclusive: int, rows: int | None, cols: int | None, exclusive_fraction: float
    ) -> HybridLightRNNCodebook:
        """Check the table arguments, install the frequency-order assignment and its derived codes."""
        name = type(self).__name__
        check_share(exclusive_fraction, "exclusive_fraction", name, "the share of the vocabulary with exclusive codes", 0.1)
        if exclusive_fraction > 0:
            implied = round(float(exclusive_fraction) * num_classes)
            if num_exclusive and num_exclusive != implied:
                raise ValueError(
                    f"{name} got num_exclusive={num_exclusive} and exclusive_fraction={exclusive_fraction}, "
                    f"which gives {implied} of {num_classes} words: they must agree (give only one: e.g. "
                    f"--model.init_args.head.init_args.exclusive_fraction 0 to use num_exclusive)"
                )
            num_exclusive = implied
        codebook = HybridLightRNNCodebook(num_classes, num_exclusive, rows, cols)
        if codebook.cols < 2 or codebook.num_first_codes < 2:
            raise ValueError(
                f"{name} needs at least 2 codes per position, got {codebook.num_first_codes} first-position "
                f"codes and {codebook.cols} columns (lower head.init_args.num_exclusive or set rows/cols; "
                f"default shape here is {default_table_shape(num_classes, num_exclusive)})"
            )
        self.num_exclusive, self.rows, self.cols = codebook.num_exclusive, codebook.rows, codebook.cols
        # The assignment is a persistent buffer (so a plain state dict carries it) and the
        # head structure (so HeadTask checkpoints restore it before the weights).
        self.register_buffer("word_to_slot", codebook.word_to_slot.clone())
        for name in ("first_code", "column_code", "row_occupied", "cell_occupied", "exclusive_word", "cell_word"):
            self.register_buffer(name, torch.empty(0), persistent=False)
        self._refresh_codes()
        self.register_load_state_dict_post_hook(lambda module, keys: module._refresh_codes())
        self.cost_accumulator: ReallocationCosts | None = None
        return codebook

    # ------------------------------------------------------------------ codes
    @property
    def codebook(self) -> HybridLightRNNCodebook:
        return HybridLightRNNCodebook(
            self.num_classes, self.num_exclusive, self.rows, self.cols, self.word_to_slot.cpu()
        )

    def _refresh_codes(self) -> None:
        """Derive the per-word codes and the occupancy masks from ``word_to_slot``."""
        K, d1, d2 = self.num_exclusive, self.rows, self.cols
        slots = self.word_to_slot
        table = (slots - K).clamp_min(0)
        is_table = slots >= K
        # first-position code: the slot itself for exclusive words, K + row for table words
        self.first_code = torch.where(is_table, K + table // d2, slots)
        self.column_code = torch.where(is_table, table % d2, torch.full_like(slots, EMPTY))
        cells = torch.zeros(d1 * d2, dtype=torch.bool, device=slots.device)
        cells[table[is_table]] = True
        self.cell_occupied = cells.view(d1, d2)  # (d1, d2)
        self.row_occupied = torch.cat([torch.ones(K, dtype=torch.bool, device=slots.device), self.cell_occupied.any(1)])
        # inverse maps for topk: exclusive code -> word, table cell -> word (EMPTY where no word)
        words = torch.arange(slots.numel(), device=slots.device)
        self.exclusive_word = torch.empty(K, dtype=torch.long, device=slots.device)
        self.exclusive_word[slots[~is_table]] = words[~is_table]
        cell_word = torch.full((d1 * d2,), EMPTY, dtype=torch.long, device=slots.device)
        cell_word[table[is_table]] = words[is_table]
        self.cell_word = cell_word.view(d1, d2)  # (d1, d2)
        self._table_full = bool(self.cell_occupied.all())
        self._rows_full = bool(self.row_occupied.all())  # P_1 needs no renormalisation

    def set_assignment(self, word_to_slot: Tensor) -> None:
        """Install a new word -> slot assignment (validated as a bijection)."""
        checked = HybridLightRNNCodebook(
            self.num_classes, self.num_exclusive, self.rows, self.cols, word_to_slot.cpu()
        ).word_to_slot
        self.word_to_slot.copy_(checked.to(self.word_to_slot.device))
        self._refresh_codes()

    # ------------------------------------------------------------------ reallocation (LightRNN §3.3)
    def collect_costs(self) -> None:
        """Start accumulating the Eq. 6 costs of the table words over the coming training passes."""
        from heads.lightrnn.allocation import ReallocationCosts

        self.cost_accumulator = ReallocationCosts(self.num_classes - self.num_exclusive, self.rows, self.cols, self.word_to_slot.device)

    def take_costs(self) -> ReallocationCosts | None:
        """The costs accumulated since :meth:`collect_costs` (None if none were collected); stops collecting."""
        costs, self.cost_accumulator = self.cost_accumulator, None
        return costs

    def table_cells(self) -> np.ndarray:
        """``(n,)`` the cell of each table word (words ``num_exclusive..V-1``), ``row * cols + col``."""
        return (self.word_to_slot[self.num_exclusive :] - self.num_exclusive).cpu().numpy()

    def propose_cells(self, row_cost: np.ndarray, col_cost: np.ndarray, solver: str = "auto", exact_max_words: int = 2000,
                      max_sweeps: int = 10) -> np.ndarray:
        """The table words' new cells ``(n,)`` minimising Eq. 6 for the costs ``row_cost (n, d1)``,
        ``col_cost (n, d2)``; never costlier than the current table. ``solver``: ``"exact"``,
        ``"approximate"`` or ``"auto"`` (exact up to ``exact_max_words`` table words)."""
        from heads.lightrnn.allocation import approximate_reallocation, exact_reallocation

        current = self.table_cells()
        if solver == "exact" or (solver == "auto" and len(current) <= exact_max_words):
            return exact_reallocation(row_cost, col_cost, current)
        return approximate_reallocation(row_cost, col_cost, current, max_sweeps)

    def install_cells(self, cells: np.ndarray) -> dict[str, float]:
        """Move the table words to ``cells (n,)``; returns the fractions of table words that
        moved (``table_change``) and that changed row (``rows_changed``)."""
        current = self.table_cells()
        change = {
            "table_change": float((cells != current).mean()) if len(current) else 0.0,
            "rows_changed": float((cells // self.cols != current // self.cols).mean()) if len(current) else 0.0,
        }
        slots = self.word_to_slot.clone()
        slots[self.num_exclusive :] = torch.as_tensor(cells, device=slots.device) + self.num_exclusive
        self.set_assignment(slots)
        return change

    def reallocate(self, solver: str = "auto", exact_max_words: int = 2000, max_sweeps: int = 10) -> dict[str, float] | None:
        """One table-learning step for a plain training loop: solve the matching for the costs
        collected since :meth:`collect_costs` and install it. Returns the table change and the
        mean code NLL per token before and after (None when no costs were collected)."""
        from heads.lightrnn.allocation import assignment_cost

        costs = self.take_costs()
        if costs is None:
            return None
        row_cost, col_cost = costs.row_cost.cpu().numpy(), costs.col_cost.cpu().numpy()
        tokens = max(float(costs.tokens.sum()), 1.0)
        before = assignment_cost(row_cost, col_cost, self.table_cells()) / tokens
        cells = self.propose_cells(row_cost, col_cost, solver, exact_max_words, max_sweeps)
        return {**self.install_cells(cells), "cost_before": before, "cost_after": assignment_cost(row_cost, col_cost, cells) / tokens}

    def structure(self) -> dict[str, Any]:
        return self.codebook.structure()

    def load_structure(self, structure: dict[str, Any]) -> None:
        mine = (self.num_classes, self.num_exclusive, self.rows, self.cols)
        saved = tuple(int(structure[k]) for k in ("num_words", "num_exclusive", "rows", "cols"))
        if saved != mine:
            raise ValueError(
                f"checkpoint's Hybrid-LightRNN table (words, K, rows, cols) = {saved} does not match this head's "
                f"{mine} (build the head with the checkpoint's num_exclusive/rows/cols)"
            )
        self.set_assignment(torch.tensor(structure["word_to_slot"], dtype=torch.long))

    # ------------------------------------------------------------------ code distributions
    def first_log_prob(self, g: Tensor) -> tuple[Tensor, Tensor]:
        """``log P_1`` over the first-position codes, raw and renormalised over occupied rows.

        Shape: ``(n, in_features) -> (n, K + d1)`` twice.
        """
        raw = self.first_head.log_prob(g)  # (n, K + d1)
        if self._rows_full:  # no empty row: renormalising would change nothing
            return raw, raw
        masked = raw.masked_fill(~self.row_occupied, float("-inf"))
        return raw, masked - torch.logsumexp(masked, dim=-1, keepdim=True)

    def column_log_prob(self, g: Tensor, row: Tensor) -> tuple[Tensor, Tensor]:
        """``log P_2(. | g + e_row)``, raw and renormalised over the row's occupied cells.

        Shape: g ``(m, in_features)``, row ``(m,)`` -> ``(m, d2)`` twice.
        """
        raw = self.column_head.log_prob(g + self.row_embedding(row))  # (m, d2)
        if self._table_full:
            return raw, raw
        masked = raw.masked_fill(~self.cell_occupied[row], float("-inf"))
        return raw, masked - torch.logsumexp(masked, dim=-1, keepdim=True)

    # ------------------------------------------------------------------ contract
    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL as the sum of code NLLs; nothing ``|V|``-wide is formed.

        When every row holds a word (always with the default table shape, which leaves fewer
        than ``d2`` cells empty) ``P_1`` needs no renormalisation and its NLL comes from the inner
        head's own ``forward``, memory-lean for MoS (no ``(n, K_mos, K + d1)`` block kept for
        backward). In an epoch that accumulates reallocation costs, the table tokens' row
        distribution is evaluated once more without autograd (a fresh dropout draw inside MoS).

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)``, zero at ``ignore_index``.
        """
        flat_target = target.reshape(-1)  # (N,)
        valid = flat_target != self.ignore_index
        g = hidden.reshape(-1, self.in_features)[valid]  # (n, in) -- ignored rows cost nothing
        words = flat_target[valid]  # (n,)
        first = self.first_code[words]  # (n,)
        if self._rows_full:  # every row holds a word: the inner head's own (memory-lean) NLL is exact
            first_raw = None
            token_nll = self.first_head(g, first)  # (n,)
        else:
            first_raw, first_lp = self.first_log_prob(g)  # (n, K + d1)
            token_nll = -first_lp.gather(1, first[:, None]).squeeze(1)  # (n,)
        in_table = words >= self.num_exclusive  # frequency order: ids < K are the exclusive words
        if bool(in_table.any()):
            row = first[in_table] - self.num_exclusive  # (m,)
            col_raw, col_lp = self.column_log_prob(g[in_table], row)  # (m, d2)
            column = self.column_code[words[in_table]]  # (m,)
            token_nll = token_nll.index_add(0, in_table.nonzero().squeeze(1), -col_lp.gather(1, column[:, None]).squeeze(1))
            if self.cost_accumulator is not None and self.training:  # validation inside the epoch must not count
                if first_raw is None:  # the row distribution of the table tokens only, no autograd
                    with torch.no_grad():
                        row_raw = self.first_head.log_prob(g[in_table])[:, self.num_exclusive :]  # (m, d1)
                else:
                    row_raw = first_raw[in_table, self.num_exclusive :]
                self.cost_accumulator.add(words[in_table] - self.num_exclusive, row_raw, col_raw)
        nll = token_nll.new_zeros(flat_target.shape)
        nll[valid] = token_nll
        return nll.view(target.shape)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Exact word log-probabilities, ``log P_1 + log P_2`` summed along each code sequence.

        Evaluates ``P_2`` once per row (``(N, d1, d2)``, about ``N |V|`` numbers, like a softmax).

        Shape:
            ``(..., in_features) -> (..., |V|)``.
        """
        K = self.num_exclusive
        g = hidden.reshape(-1, self.in_features)  # (N, in)
        N = g.shape[0]
        _, first_lp = self.first_log_prob(g)  # (N, K + d1)
        contexts = g[:, None, :] + self.row_embedding.weight[None]  # (N, d1, in): g + e_r for every row
        col_lp = self.column_head.log_prob(contexts.reshape(N * self.rows, self.in_features))  # (N d1, d2)
        col_lp = col_lp.view(N, self.rows, self.cols)  # (N, d1, d2)
        if not self._table_full:
            col_lp = col_lp.masked_fill(~self.cell_occupied, float("-inf"))
            col_lp = col_lp - torch.logsumexp(col_lp, dim=-1, keepdim=True)
            col_lp = col_lp.nan_to_num(nan=float("-inf"))  # rows with no word: -inf - (-inf)
        word_first = first_lp[:, self.first_code]  # (N, |V|)
        table = self.word_to_slot[K:] - K
        word_col = col_lp.reshape(N, -1)[:, table]  # (N, |V| - K)
        out = torch.cat([word_first[:, :K], word_first[:, K:] + word_col], dim=1)  # (N, |V|)
        return out.view(*hidden.shape[:-1], self.num_classes)

    def topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Exactly the ``k`` most probable words without forming the ``|V|``-wide distribution.

        A table word's log-probability is its row's ``log P_1`` plus a column log-probability
        ``<= 0``, so no word of a row can beat the row's own ``log P_1``. Rows are visited per
        context in decreasing ``log P_1``, ``P_2`` evaluated for a growing chunk of them at a time
        (k, then doubling), and a context stops once its ``k``-th best word so far is at least
        the next row's bound. A peaked ``P_1`` touches a few rows instead of all ``d1``; the
        worst case is :meth:`log_prob`'s work. Ties at the bound may be broken differently from
        ``log_prob(hidden).topk(k)``.

        Shape:
            hidden ``(..., in_features)`` -> ``(log_probs, indices)``, each ``(..., k)``.
        """
        if not 1 <= k <= self.num_classes:
            raise ValueError(f"topk needs 1 <= k <= num_classes={self.num_classes}, got k={k}")
        if torch.compiler.is_compiling():
            # torch.export / torch.compile: the early stop is control flow on the data, so a traced
            # program ranks the whole distribution (log_prob's work: the search's worst case)
            return self.log_prob(hidden).topk(k, dim=-1)
        K = self.num_exclusive
        g = hidden.reshape(-1, self.in_features)  # (N, in)
        _, first_lp = self.first_log_prob(g)  # (N, K + d1)
        best, best_word = best_words(
            first_lp[:, :K], self.exclusive_word, first_lp[:, K:], self.cell_word,
            lambda contexts, rows: self.column_log_prob(g[contexts], rows)[1], k,
        )
        return best.view(*hidden.shape[:-1], k), best_word.view(*hidden.shape[:-1], k)

    @torch.no_grad()
    def init_unigram_bias(self, log_unigram: Tensor) -> bool:
        """Start both code heads at the code unigrams the word unigram implies: ``P_1`` at each
        first code's share (an exclusive word's own, a row's summed over its words) and ``P_2`` at
        the column codes' shares among table words. Returns whether both inner heads took it."""
        if log_unigram.shape != (self.num_classes,):
            raise ValueError(
                f"{type(self).__name__} needs a log-unigram vector of shape ({self.num_classes},), got "
                f"{tuple(log_unigram.shape)} (the counts must come from the head's own vocabulary)"
            )
        p = log_unigram.double().exp()  # (V,)
        first = torch.zeros(self.first_head.num_classes, dtype=torch.float64, device=p.device)
        first.index_add_(0, self.first_code, p)
        table = self.column_code != EMPTY
        column = torch.zeros(self.cols, dtype=torch.float64, device=p.device)
        column.index_add_(0, self.column_code[table], p[table])
        tiny = torch.finfo(torch.float64).tiny  # empty rows / columns: a very low, finite start
        took_first = self.first_head.init_unigram_bias(torch.log((first / first.sum()).clamp_min(tiny)).float())
        took_column = bool(table.any()) and self.column_head.init_unigram_bias(
            torch.log((column / column.sum()).clamp_min(tiny)).float())
        return took_first and took_column

    def stats(self) -> dict[str, Tensor | float]:
        """Rows holding at least one word (empty rows appear when reallocation gathers the
        table's empty cells into one row)."""
        return {"occupied_rows": float(self.row_occupied[self.num_exclusive :].sum())}

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, num_classes={self.num_classes}, "
            f"num_exclusive={self.num_exclusive}, table={self.rows}x{self.cols}"
        )


def _merge_topk(values: Tensor, indices: Tensor, new_values: Tensor, new_indices: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Best ``k`` of two scored candidate sets per row. Shape ``(n, a)`` and ``(n, b)`` -> ``(n, k)``."""
    all_values = torch.cat([values, new_values], dim=1)
    top, position = all_values.topk(k, dim=1)
    return top, torch.cat([indices, new_indices], dim=1).gather(1, position)


def best_words(
    exclusive_lp: Tensor, exclusive_word: Tensor, row_lp: Tensor, cell_word: Tensor,
    column_log_prob: Callable[[Tensor, Tensor], Tensor], k: int,
) -> tuple[Tensor, Tensor]:
    """The ``k`` most probable words: the exclusive words, then the table words, visiting rows in
    decreasing ``log P``.

    A table word's log-probability is its row code's plus a column log-probability ``<= 0``, so
    no word of a row beats the row's own log-probability: each context visits its rows best first,
    a growing chunk at a time (``k``, then doubling), and stops once its ``k``-th best word so far is
    at least the next row's bound. Shared by :meth:`HybridLightRNN.topk` (the column distribution
    from a row embedding) and the code-input decoder (:class:`tasks.code_search.CodeStep`, one
    network step per visited row).

    Args:
        exclusive_lp: ``(N, K)`` log-probability of each exclusive code (``K`` may be 0).
        exclusive_word: ``(K,)`` the word of each exclusive code.
        row_lp: ``(N, d1)`` log-probability of each row's code (``-inf`` for an empty row).
        cell_word: ``(d1, d2)`` word in each table cell, ``EMPTY`` where none.
        column_log_prob: ``(contexts (m,), rows (m,)) -> (m, d2)`` renormalised column log-probabilities
            of row ``rows[i]`` for context ``contexts[i]``.
    Returns ``(N, k)`` scores and words, best first.
    """
    N, K = row_lp.shape[0], exclusive_lp.shape[1]
    best = row_lp.new_full((N, k), float("-inf"))  # (N, k) best word scores so far
    best_word = torch.zeros(N, k, dtype=torch.long, device=row_lp.device)
    if K:
        best, best_word = _merge_topk(best, best_word, exclusive_lp, exclusive_word.expand(N, K), k)
    bound, order = row_lp.sort(dim=-1, descending=True)  # (N, d1): rows by log P
    done, chunk, d1 = 0, k, row_lp.shape[1]
    while done < d1:
        needed = (bound[:, done] > best[:, -1]).nonzero().squeeze(1)  # contexts a next row could improve
        if needed.numel() == 0:
            break
        rows = order[needed, done : done + chunk]  # (n, c)
        n, c = rows.shape
        col_lp = column_log_prob(needed.repeat_interleave(c), rows.reshape(-1))  # (n c, d2)
        scores = bound[needed, done : done + c].unsqueeze(-1) + col_lp.view(n, c, -1)  # (n, c, d2)
        words = cell_word[rows]  # (n, c, d2)
        scores = scores.masked_fill(words == EMPTY, float("-inf")).nan_to_num(nan=float("-inf"))
        merged = _merge_topk(best[needed], best_word[needed], scores.reshape(n, -1), words.reshape(n, -1).clamp_min(0), k)
        best[needed], best_word[needed] = merged
        done, chunk = done + c, chunk * 2
    return best, best_word
