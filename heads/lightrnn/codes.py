"""The Hybrid-LightRNN vocabulary encoding as data: which code sequence each word has.

Seed 002 (Kong et al., "Fast and Simple Mixture of Softmaxes with BPE and Hybrid-LightRNN")
writes every word ``w`` of a vocabulary ``V`` as a code sequence of length one or two over a
small code dictionary:

* the ``K`` most frequent words own an *exclusive* length-1 code each (the diagonal block
  ``D`` of the paper's figure);
* every other word sits in one cell ``(row, column)`` of a ``d1 x d2`` table ``L`` and is
  written as the pair (row code, column code); ``K + d1 d2 >= |V|``.

LightRNN (Li et al., NeurIPS 2016) is the special case ``K = 0``, ``d1 = d2 = ceil(sqrt|V|)``.

The encoding is stored as one integer per word, its *slot*: slots ``0 .. K-1`` are the
exclusive codes, slot ``K + r d2 + c`` is table cell ``(r, c)``. The first-position code
dictionary has ``K + d1`` entries (``K`` exclusive codes, then the ``d1`` row codes), the
second-position dictionary ``d2`` column codes. Table learning (``tasks.callbacks.LightRNNReallocation``)
only permutes the table words among the table cells; the exclusive words never move.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from heads.validation import check_positive_int

EMPTY = -1  # slot_to_word value of an unoccupied table cell


def default_table_shape(num_words: int, num_exclusive: int) -> tuple[int, int]:
    """The smallest near-square table for the ``num_words - num_exclusive`` table words:
    ``d2 = ceil(sqrt(n))``, ``d1 = ceil(n / d2)`` (so no row starts empty)."""
    n = max(1, num_words - num_exclusive)
    cols = math.ceil(math.sqrt(n))
    return math.ceil(n / cols), cols


def check_encoding_sizes(num_words: int, num_exclusive: int, rows: int, cols: int, owner: str) -> None:
    """One-line ValueErrors for a code dictionary that cannot encode ``num_words`` words."""
    if isinstance(num_exclusive, bool) or not isinstance(num_exclusive, int) or not 0 <= num_exclusive <= num_words:
        raise ValueError(
            f"{owner} needs num_exclusive to be an integer in [0, {num_words}] (the vocabulary size), "
            f"got {num_exclusive!r} (set head.init_args.num_exclusive)"
        )
    check_positive_int(rows, "rows", owner)
    check_positive_int(cols, "cols", owner)
    if num_exclusive + rows * cols < num_words:
        raise ValueError(
            f"{owner} needs num_exclusive + rows * cols >= vocabulary size {num_words}, got "
            f"{num_exclusive} + {rows} * {cols} = {num_exclusive + rows * cols} (raise head.init_args.rows/cols "
            f"or num_exclusive, or leave rows and cols unset for the smallest square table)"
        )


class HybridLightRNNCodebook:
    """Word <-> code-sequence bijection of Hybrid-LightRNN (see the module docstring).

    Args:
        num_words: vocabulary size ``|V|``; ids sorted by decreasing frequency.
        num_exclusive: ``K``, number of most frequent words with an exclusive length-1 code.
        rows, cols: table shape ``d1 x d2``; default :func:`default_table_shape`.
        word_to_slot: an existing assignment (``(|V|,)`` integers); default the frequency
            initialisation: word ``i`` in slot ``i`` (exclusive codes for ids ``< K``, then the
            table filled row by row in frequency order).
    """

    def __init__(
        self,
        num_words: int,
        num_exclusive: int = 0,
        rows: int | None = None,
        cols: int | None = None,
        word_to_slot: Tensor | None = None,
    ) -> None:
        if (rows is None) != (cols is None):
            raise ValueError(
                f"HybridLightRNNCodebook needs rows and cols both set or both unset, got rows={rows}, "
                f"cols={cols} (set head.init_args.rows and head.init_args.cols together)"
            )
        check_encoding_sizes(num_words, num_exclusive, num_words, 1, "HybridLightRNNCodebook")  # K alone
        if rows is None:
            rows, cols = default_table_shape(num_words, num_exclusive)
        check_encoding_sizes(num_words, num_exclusive, rows, cols, "HybridLightRNNCodebook")
        self.num_words, self.num_exclusive, self.rows, self.cols = num_words, num_exclusive, rows, cols
        if word_to_slot is None:
            word_to_slot = torch.arange(num_words)  # frequency initialisation
        self.word_to_slot = self.check_assignment(torch.as_tensor(word_to_slot, dtype=torch.long))

    # ------------------------------------------------------------------ sizes
    @property
    def num_slots(self) -> int:
        """``K + d1 d2``."""
        return self.num_exclusive + self.rows * self.cols

    @property
    def num_first_codes(self) -> int:
        """Size of the first-position code dictionary: ``K`` exclusive codes + ``d1`` rows."""
        return self.num_exclusive + self.rows

    @property
    def table_words(self) -> int:
        return self.num_words - self.num_exclusive

    # ------------------------------------------------------------------ validation
    def check_assignment(self, word_to_slot: Tensor) -> Tensor:
        """Refuse an assignment that is not an injective map of words into slots which keeps
        the exclusive words on their own codes."""
        if word_to_slot.shape != (self.num_words,):
            raise ValueError(
                f"HybridLightRNNCodebook needs one slot per word ({self.num_words}), got shape "
                f"{tuple(word_to_slot.shape)} (use a table saved for this vocabulary)"
            )
        K = self.num_exclusive
        if not torch.equal(word_to_slot[:K], torch.arange(K)):
            raise ValueError("HybridLightRNNCodebook: the K most frequent words must keep exclusive codes 0..K-1")
        table = word_to_slot[K:]
        if table.numel() and (table.min() < K or table.max() >= self.num_slots):
            raise ValueError(
                f"HybridLightRNNCodebook: table words need slots in [{K}, {self.num_slots}), got "
                f"[{int(table.min())}, {int(table.max())}] (use a table saved for this shape)"
            )
        if torch.unique(word_to_slot).numel() != self.num_words:
            raise ValueError("HybridLightRNNCodebook: two words share a slot, so the encoding is not a bijection")
        return word_to_slot

    # ------------------------------------------------------------------ encode / decode
    def slot_to_word(self) -> Tensor:
        """Inverse map, ``(K + d1 d2,)`` with :data:`EMPTY` at unoccupied cells."""
        inverse = torch.full((self.num_slots,), EMPTY, dtype=torch.long)
        inverse[self.word_to_slot] = torch.arange(self.num_words)
        return inverse

    def encode(self, words: Tensor) -> list[tuple[int, ...]]:
        """Code sequences of ``words``: ``(k,)`` for an exclusive code ``k`` in the
        first-position dictionary, ``(K + r, c)`` for table cell ``(r, c)``."""
        out: list[tuple[int, ...]] = []
        for slot in self.word_to_slot[words].tolist():
            if slot < self.num_exclusive:
                out.append((slot,))
            else:
                r, c = divmod(slot - self.num_exclusive, self.cols)
                out.append((self.num_exclusive + r, c))
        return out

    def decode(self, codes: list[tuple[int, ...]]) -> Tensor:
        """Inverse of :meth:`encode` (raises on a code sequence no word has)."""
        inverse = self.slot_to_word()
        words = []
        for seq in codes:
            if len(seq) == 1 and 0 <= seq[0] < self.num_exclusive:
                slot = seq[0]
            elif len(seq) == 2 and self.num_exclusive <= seq[0] < self.num_first_codes and 0 <= seq[1] < self.cols:
                slot = self.num_exclusive + (seq[0] - self.num_exclusive) * self.cols + seq[1]
            else:
                raise ValueError(f"code sequence {seq} is not in this code dictionary")
            if inverse[slot] == EMPTY:
                raise ValueError(f"code sequence {seq} is an empty table cell")
            words.append(int(inverse[slot]))
        return torch.tensor(words, dtype=torch.long)

    def rows_and_cols(self) -> tuple[Tensor, Tensor]:
        """Row and column of every table word (``(|V| - K,)`` each, in word order)."""
        table = self.word_to_slot[self.num_exclusive :] - self.num_exclusive
        return table // self.cols, table % self.cols

    def table_rows(self, itos: list[str], max_rows: int = 10, max_words: int = 12) -> list[tuple[int, list[str]]]:
        """The words sharing each row (seed 002 Table 6 style), for the ``max_rows`` rows whose
        words are most frequent on average; each row's words in column order."""
        if len(itos) != self.num_words:
            raise ValueError(f"table_rows needs one string per word ({self.num_words}), got {len(itos)}")
        rows, cols = self.rows_and_cols()
        members: dict[int, list[tuple[int, int]]] = {}
        for index, (r, c) in enumerate(zip(rows.tolist(), cols.tolist())):
            members.setdefault(r, []).append((c, self.num_exclusive + index))
        ranked = sorted(members, key=lambda r: sum(w for _, w in members[r]) / len(members[r]))
        return [(r, [itos[w] for _, w in sorted(members[r])[:max_words]]) for r in ranked[:max_rows]]

    # ------------------------------------------------------------------ persistence
    def structure(self) -> dict[str, Any]:
        return {
            "num_words": self.num_words,
            "num_exclusive": self.num_exclusive,
            "rows": self.rows,
            "cols": self.cols,
            "word_to_slot": self.word_to_slot.tolist(),
        }

    @classmethod
    def from_structure(cls, structure: dict[str, Any]) -> "HybridLightRNNCodebook":
        return cls(
            int(structure["num_words"]), int(structure["num_exclusive"]), int(structure["rows"]),
            int(structure["cols"]), torch.tensor(structure["word_to_slot"], dtype=torch.long),
        )
