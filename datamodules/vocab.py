"""Frequency-ordered vocabularies shared by every text data source.

Id order is a documented contract (heads such as Mixtape and DS-Softmax analyses rely on
it): the special tokens first, in the order given, then every other token by decreasing
count, ties broken by first appearance so the order is deterministic.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import torch


class Vocabulary:
    """A mapping between tokens and ids with specials first, then decreasing frequency.

    Args:
        counts: token counts from the training split (insertion order breaks ties).
        specials: tokens that get the first ids whatever their count.
        max_size: keep at most this many tokens in total (specials included).
        min_count: drop tokens seen fewer times than this.
        unk: the token unknown words map to; must be among ``specials`` if given.
    """

    def __init__(
        self,
        counts: Counter | dict[str, int],
        specials: Sequence[str] = ("<unk>", "<eos>"),
        max_size: int | None = None,
        min_count: int = 1,
        unk: str | None = "<unk>",
    ) -> None:
        if unk is not None and unk not in specials:
            raise ValueError(f"unk token {unk!r} must be one of the specials {list(specials)}")
        order = {token: i for i, token in enumerate(counts)}
        ranked = sorted(
            (t for t, c in counts.items() if c >= min_count and t not in specials),
            key=lambda t: (-counts[t], order[t]),
        )
        itos = list(specials) + ranked
        if max_size is not None:
            itos = itos[:max_size]
        self.itos: list[str] = itos
        self.stoi: dict[str, int] = {t: i for i, t in enumerate(itos)}
        self.unk = unk
        self.counts = {t: int(counts.get(t, 0)) for t in itos}

    @classmethod
    def from_itos(cls, itos: Sequence[str], unk: str | None = "<unk>") -> "Vocabulary":
        vocab = cls.__new__(cls)
        vocab.itos = list(itos)
        vocab.stoi = {t: i for i, t in enumerate(vocab.itos)}
        vocab.unk = unk
        vocab.counts = {}
        return vocab

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, token: str) -> bool:
        return token in self.stoi

    def index(self, token: str) -> int:
        if token in self.stoi:
            return self.stoi[token]
        if self.unk is None:
            raise KeyError(f"token {token!r} is not in the vocabulary and it has no unk token")
        return self.stoi[self.unk]

    def encode(self, tokens: Iterable[str]) -> list[int]:
        return [self.index(t) for t in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.itos[int(i)] for i in ids]

    def encode_tensor(self, tokens: Iterable[str]) -> torch.Tensor:
        return torch.tensor(self.encode(tokens), dtype=torch.long)
