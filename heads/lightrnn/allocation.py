"""Word reallocation for Hybrid-LightRNN: the Eq. 6 costs and the matching that minimises them
(LightRNN, Li et al. 2016, §3.3; seed 002 §3, Eq. 6).

During the training forward passes of an epoch the head accumulates, for each table word, its
code negative log-likelihoods for every row and every column (:class:`ReallocationCosts`).
Placing word ``w`` in cell ``(r, c)`` costs ``C[w, (r, c)] = R[w, r] + Cc[w, c]`` (Eq. 6), and
the new table is the assignment of words to cells of least total cost: a minimum-cost
bipartite matching.

* :func:`exact_reallocation` solves it with :func:`scipy.optimize.linear_sum_assignment` on
  the full ``(|V| - K) x (d1 d2)`` matrix (``O(n^3)``: fine up to a few thousand words).
* :func:`approximate_reallocation` is the fast matching for large vocabularies: block
  coordinate descent (:func:`block_descent`). A *row step* re-solves, exactly, the
  assignment of the words currently in row ``r`` to the cells of row ``r`` (their row cost is
  fixed there, so it is a ``d2 x d2`` problem on ``Cc``); a *column step* does the same for
  each column with ``R`` (``d1 x d1``). Every step is an exact solution of a sub-problem that
  contains the current placement, so the total cost never increases; any word can reach any
  cell in one row step plus one column step. Sweeps repeat until the cost stops falling.
  Descent runs twice, from the current table and from a greedy-by-regret table
  (:func:`greedy_by_regret`: words whose best cell beats their second best by the most
  choose first), and the cheaper result is kept. A sweep is ``2 sqrt|V|`` assignments of
  ``sqrt|V| x sqrt|V|``, against ``O(|V|^3)`` for the exact solver
  (tests/test_hybrid_lightrnn.py checks it against the exact solver on small instances).

Both keep the current table unless the new one is strictly cheaper.

*Deviation from seed 002.* Seed 002 (§3, after Eq. 6), following LightRNN, solves this matching
with Preis's linear-time 1/2-approximation for maximum weighted matching (Preis 1999), which only
guarantees half of the optimal matching weight. This project solves it exactly instead (SciPy's
``linear_sum_assignment``, a maintained library solver, rather than a transcription of Preis's
algorithm), and past ``exact_max_words`` with the block descent above, which is not Preis's
algorithm either. Why: the paper approximates because an exact solver costs ``O(|V|^3)`` at its
vocabulary sizes; up to ``exact_max_words`` table words (2,000 by default) that cost is
affordable once per reallocation epoch, and the exact solver gives the least-cost table the Eq. 6
costs allow (never a costlier one than an approximation), deterministically, so it is also the
reference the approximate path is tested against. Larger tables get the block descent, whose
every step is an exact sub-problem and whose cost never rises.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from heads.lightrnn.codes import EMPTY


class ReallocationCosts:
    """Per-word accumulated code negative log-likelihoods (seed 002 Eq. 6 / LightRNN §3.3).

    For table word ``w`` (index ``w - K``) over its occurrences ``t`` in the data seen:
    ``row_cost[w, r] = -sum_t log P_1(K + r | g_t)`` and
    ``col_cost[w, c] = -sum_t log P_2(c | g_t + e_{row(w)})``, so placing ``w`` in cell
    ``(r, c)`` costs ``row_cost[w, r] + col_cost[w, c]``. As in LightRNN, the column term is
    measured under the word's current row (evaluating every candidate row would cost ``d1``
    column passes per token). Both use the inner heads' raw distributions (no renormalisation
    over occupied cells), which do not depend on the assignment being optimised.
    """

    def __init__(self, table_words: int, rows: int, cols: int, device: torch.device) -> None:
        self.row_cost = torch.zeros(table_words, rows, dtype=torch.float64, device=device)
        self.col_cost = torch.zeros(table_words, cols, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(table_words, dtype=torch.float64, device=device)

    def add(self, words: Tensor, row_log_prob: Tensor, col_log_prob: Tensor) -> None:
        """Shape: words ``(m,)`` table-word indices, row_log_prob ``(m, d1)``, col_log_prob ``(m, d2)``."""
        self.row_cost.index_add_(0, words, -row_log_prob.detach().double())
        self.col_cost.index_add_(0, words, -col_log_prob.detach().double())
        self.tokens.index_add_(0, words, torch.ones_like(words, dtype=torch.float64))


@runtime_checkable
class TableLearning(Protocol):
    """What the reallocation callback (``tasks.callbacks.LightRNNReallocation``) needs from a head
    that learns its word table (:class:`heads.lightrnn.HybridLightRNN`)."""

    num_classes: int

    def collect_costs(self) -> None: ...

    def take_costs(self) -> ReallocationCosts | None: ...

    def table_cells(self) -> np.ndarray: ...  # (n,) current cell of each table word

    def propose_cells(self, row_cost: np.ndarray, col_cost: np.ndarray, solver: str = "auto",
                      exact_max_words: int = 2000, max_sweeps: int = 10) -> np.ndarray: ...

    def install_cells(self, cells: np.ndarray) -> dict[str, float]: ...


#: A new table must beat the current one by more than this relative margin (float noise).
RELATIVE_TOLERANCE = 1e-9


def assignment_cost(row_cost: np.ndarray, col_cost: np.ndarray, cells: np.ndarray) -> float:
    """Total cost ``sum_w R[w, row(w)] + Cc[w, col(w)]`` of table words placed in ``cells``.

    Shape: row_cost ``(n, d1)``, col_cost ``(n, d2)``, cells ``(n,)`` flat cell ids ``r d2 + c``.
    """
    d2 = col_cost.shape[1]
    words = np.arange(len(cells))
    return float(row_cost[words, cells // d2].sum() + col_cost[words, cells % d2].sum())


def _keep_better(row_cost: np.ndarray, col_cost: np.ndarray, current: np.ndarray, proposal: np.ndarray) -> np.ndarray:
    before, after = assignment_cost(row_cost, col_cost, current), assignment_cost(row_cost, col_cost, proposal)
    return proposal if after < before - RELATIVE_TOLERANCE * max(1.0, abs(before)) else current


def exact_reallocation(row_cost: np.ndarray, col_cost: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Minimum-cost placement of the table words by the Hungarian-type solver.

    Shape: row_cost ``(n, d1)``, col_cost ``(n, d2)``, current ``(n,)`` -> cells ``(n,)``.
    """
    from scipy.optimize import linear_sum_assignment  # optional dependency: only where a matching is solved

    n, d1 = row_cost.shape
    d2 = col_cost.shape[1]
    full = (row_cost[:, :, None] + col_cost[:, None, :]).reshape(n, d1 * d2)  # (n, d1 d2): Eq. 6 per cell
    words, cells = linear_sum_assignment(full)
    proposal = np.empty(n, dtype=np.int64)
    proposal[words] = cells
    return _keep_better(row_cost, col_cost, current, proposal)


def greedy_by_regret(row_cost: np.ndarray, col_cost: np.ndarray) -> np.ndarray:
    """Each word, in order of decreasing regret (second-best minus best cell cost), takes its
    cheapest free cell.

    Shape: row_cost ``(n, d1)``, col_cost ``(n, d2)`` -> cells ``(n,)``.
    """
    n, d1 = row_cost.shape
    d2 = col_cost.shape[1]
    sorted_row, sorted_col = np.sort(row_cost, axis=1), np.sort(col_cost, axis=1)
    row_gap = sorted_row[:, 1] - sorted_row[:, 0] if d1 > 1 else np.full(n, np.inf)
    col_gap = sorted_col[:, 1] - sorted_col[:, 0] if d2 > 1 else np.full(n, np.inf)
    order = np.argsort(-np.minimum(row_gap, col_gap), kind="stable")
    taken = np.zeros(d1 * d2, dtype=bool)
    cells = np.empty(n, dtype=np.int64)
    for word in order:
        cost = (row_cost[word][:, None] + col_cost[word][None, :]).reshape(-1)  # (d1 d2,)
        cost[taken] = np.inf
        cells[word] = int(np.argmin(cost))
        taken[cells[word]] = True
    return cells


def block_descent(row_cost: np.ndarray, col_cost: np.ndarray, start: np.ndarray, max_sweeps: int = 10) -> np.ndarray:
    """Row/column block coordinate descent from ``start`` (see the module docstring); the
    result never costs more than ``start``.

    Shape: row_cost ``(n, d1)``, col_cost ``(n, d2)``, start ``(n,)`` -> cells ``(n,)``.
    """
    from scipy.optimize import linear_sum_assignment  # optional dependency: only where a matching is solved

    n, d1 = row_cost.shape
    d2 = col_cost.shape[1]
    grid = np.full(d1 * d2, EMPTY, dtype=np.int64)
    grid[start] = np.arange(n)
    grid = grid.reshape(d1, d2)  # (d1, d2): word in each cell, EMPTY where none
    # An empty cell behaves as a phantom word of zero cost everywhere, so it can move too.
    padded_row = np.vstack([row_cost, np.zeros((1, d1))])  # (n + 1, d1): row n is the phantom
    padded_col = np.vstack([col_cost, np.zeros((1, d2))])  # (n + 1, d2)
    current, cost = start, assignment_cost(row_cost, col_cost, start)
    for _ in range(max_sweeps):
        for r in range(d1):  # row step: permute row r's words over its d2 cells (row cost fixed)
            occupants = np.where(grid[r] == EMPTY, n, grid[r])  # (d2,)
            who, where = linear_sum_assignment(padded_col[occupants])  # (d2, d2) problem
            grid[r, where] = grid[r, who]
        for c in range(d2):  # column step: permute column c's words over its d1 cells
            occupants = np.where(grid[:, c] == EMPTY, n, grid[:, c])  # (d1,)
            who, where = linear_sum_assignment(padded_row[occupants])  # (d1, d1) problem
            grid[where, c] = grid[who, c]
        flat = grid.reshape(-1)
        occupied = flat != EMPTY
        proposal = np.empty(n, dtype=np.int64)
        proposal[flat[occupied]] = np.nonzero(occupied)[0]
        new_cost = assignment_cost(row_cost, col_cost, proposal)
        converged = new_cost >= cost - RELATIVE_TOLERANCE * max(1.0, abs(cost))
        if new_cost <= cost:
            current, cost = proposal, new_cost
        if converged:
            break
    return current


def approximate_reallocation(
    row_cost: np.ndarray, col_cost: np.ndarray, current: np.ndarray, max_sweeps: int = 10
) -> np.ndarray:
    """Block descent from the current table and from the greedy-by-regret table; the cheaper
    result if it beats ``current``, else ``current``.

    Shape: row_cost ``(n, d1)``, col_cost ``(n, d2)``, current ``(n,)`` -> cells ``(n,)``.
    """
    if len(current) == 0:
        return current
    from_current = block_descent(row_cost, col_cost, current, max_sweeps)
    from_greedy = block_descent(row_cost, col_cost, greedy_by_regret(row_cost, col_cost), max_sweeps)
    best = min((from_current, from_greedy), key=lambda cells: assignment_cost(row_cost, col_cost, cells))
    return _keep_better(row_cost, col_cost, current, best)
